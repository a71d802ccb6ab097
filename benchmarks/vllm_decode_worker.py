"""vLLM's side of benchmarks/bench_architectures.py, run by .venv-vllm/bin/python (no hybridspec needed): one model,
vLLM's engine in-process, prefill and plain greedy decode timed as the parent times the others.

argv[1] is a JSON object {"model": HF_DIR, "prompt": [token ids], "new": N, "repeats": R, "dtype": "float32",
"threads": T}. Prints
`@@result {"prefill_ms": ..., "decode_ms": ..., "tokens": [...]}` (the median ms of a call with max_tokens=1 and of
one with N + 1, the tokens of a short greedy call to check against the others) or `@@error {"error": ...}` and exits 3.
Prefix caching off, so every call runs its whole prompt.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

MARK = "@@"


def reply(kind: str, payload: dict) -> None:
    print(f"{MARK}{kind} {json.dumps(payload)}", flush=True)  # vLLM logs to stdout too: the parent reads marked lines


def main() -> int:
    job = json.loads(sys.argv[1])
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True,
                  enable_prefix_caching=False, max_model_len=len(job["prompt"]) + job["new"] + 16,
                  max_num_seqs=1, seed=0)
    except Exception as e:  # an architecture or a dtype vLLM's CPU backend does not run
        reply("error", {"error": f"{type(e).__name__}: {e}"[:400]})
        return 3
    import torch

    torch._C.set_num_threads(job.get("threads", 2))  # vLLM's CPU worker replaces torch.set_num_threads with a no-op
    prompt = {"prompt_token_ids": job["prompt"]}

    def run(n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
        return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    tokens = run(8)
    times: dict[int, list[float]] = {1: [], job["new"] + 1: []}
    for _ in range(job["repeats"] + 1):  # the first round warms up
        for n in times:
            start = time.perf_counter()
            run(n)
            times[n].append((time.perf_counter() - start) * 1000)
    prefill, whole = (statistics.median(t[1:]) for t in times.values())
    reply("result", {"prefill_ms": prefill, "decode_ms": (whole - prefill) / job["new"], "tokens": tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
