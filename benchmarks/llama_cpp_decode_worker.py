"""llama.cpp's side of benchmarks/bench_architectures.py, run by .venv-peers/bin/python (llama-cpp-python; no
hybridspec needed): one GGUF, prefill and plain greedy decode timed as the parent times the others.

argv[1] is a JSON object {"gguf": PATH, "prompt": [token ids], "new": N, "repeats": R, "threads": T}. Prints
`@@result {"prefill_ms": ..., "decode_ms": ..., "tokens": [...]}` (the median ms of the prompt to its first token and
per decoded token after it; the first tokens, greedy) or `@@error {"error": ...}` and exits 3.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def reply(kind: str, payload: dict) -> None:
    print(f"@@{kind} {json.dumps(payload)}", flush=True)


def main() -> int:
    job = json.loads(sys.argv[1])
    try:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=len(job["prompt"]) + job["new"] + 16, n_batch=512,
                              n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)  # float32 as the others
    except Exception as e:  # an architecture this llama.cpp does not read
        reply("error", {"error": f"{type(e).__name__}: {e}"[:400]})
        return 3

    def greedy() -> int:  # the last input's logits (Llama.scores holds them only with logits_all)
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))

    def run(n: int) -> tuple[float, float, list[int]]:
        """The prompt and n tokens by greedy decoding: (ms to the first token, ms per token after it, the tokens)."""
        llm.reset()
        start = time.perf_counter()
        llm.eval(job["prompt"])
        tokens = [greedy()]
        first = time.perf_counter()
        while len(tokens) < n:
            llm.eval(tokens[-1:])
            tokens.append(greedy())
        end = time.perf_counter()
        return (first - start) * 1000, (end - first) * 1000 / max(1, n - 1), tokens

    tokens = run(8)[2]
    runs = [run(job["new"] + 1) for _ in range(job["repeats"] + 1)][1:]  # the first warms up
    reply("result", {"prefill_ms": statistics.median(r[0] for r in runs),
                     "decode_ms": statistics.median(r[1] for r in runs), "tokens": tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
