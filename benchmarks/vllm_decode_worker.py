"""vLLM's side of benchmarks/bench_architectures.py, run by .venv-vllm/bin/python: one model, vLLM's engine
in-process and hybridspec's Engine (installed in .venv-vllm by scripts/setup_vllm.sh) on the same weights, timed in
turns in this one process, so that both meet the same minutes of this host (its memory bandwidth drifts by a third
between minutes; two processes minutes apart compare the host as much as the engines).

argv[1] is a JSON object {"model": HF_DIR, "prompt": [token ids], "new": N, "repeats": R, "dtype": "float32",
"threads": T}. Prints `@@result {"prefill_ms": ..., "decode_ms": ..., "tokens": [...], "hybridspec_prefill_ms":
..., "hybridspec_decode_ms": ..., "prefill_ratio": ..., "decode_ratio": ...}`: each engine's median ms of a call with
max_tokens=1 and per token of one with N + 1 more, vLLM's over ours as the median of the rounds' ratios (below 1:
vLLM is faster), the tokens of a short greedy call of vLLM's to check against the others; or `@@error {"error": ...}`
and exits 3. Prefix caching off in both, so every call runs its whole prompt. A round runs vLLM and ours in turns,
their order swapped every round; ours waits for the engine's loop thread to end before vLLM runs (its OpenMP team
would otherwise slow vLLM's, `EngineLoop.wait_idle`).
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

    from hybridspec.model.target import TargetModel
    from hybridspec.runtime.engine import Engine
    from hybridspec.tools.testing import tiny_tokenizer

    torch._C.set_num_threads(job.get("threads", 2))  # vLLM's CPU worker replaces torch.set_num_threads with a no-op
    engine = Engine(TargetModel.from_pretrained(job["model"], dtype=getattr(torch, job.get("dtype", "float32"))),
                    tiny_tokenizer(128), prefix_cache_bytes=0, verify_cost=None)
    prompt = {"prompt_token_ids": job["prompt"]}

    def vllm_run(n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
        return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    def ours_run(n: int) -> list[int]:
        with torch.inference_mode():
            tokens = engine.generate(job["prompt"], max_new_tokens=n, speculate="none", ignore_eos=True).token_ids
        engine.loop.wait_idle()
        return tokens

    tokens = vllm_run(8)
    if ours_run(8) != tokens:
        reply("error", {"error": "hybridspec and vLLM decoded different tokens in one process"})
        return 3
    runs = {"vllm": vllm_run, "hybridspec": ours_run}
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in runs for n in (1, job["new"] + 1)}
    for round_ in range(job["repeats"] + 1):  # the first round warms up
        for name in (("vllm", "hybridspec") if round_ % 2 else ("hybridspec", "vllm")):
            for n in (1, job["new"] + 1):
                start = time.perf_counter()
                runs[name](n)
                times[name, n].append((time.perf_counter() - start) * 1000)
    per_round = {name: ([t for t in times[name, 1][1:]],
                        [(whole - first) / job["new"] for first, whole in
                         zip(times[name, 1][1:], times[name, job["new"] + 1][1:])]) for name in runs}
    theirs, ours = per_round["vllm"], per_round["hybridspec"]
    reply("result", {"prefill_ms": statistics.median(theirs[0]), "decode_ms": statistics.median(theirs[1]),
                     "tokens": tokens, "hybridspec_prefill_ms": statistics.median(ours[0]),
                     "hybridspec_decode_ms": statistics.median(ours[1]),
                     "prefill_ratio": statistics.median(a / b for a, b in zip(theirs[0], ours[0])),
                     "decode_ratio": statistics.median(a / b for a, b in zip(theirs[1], ours[1]))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
