"""vLLM's side of benchmarks/bench_agent_calls.py: one long-lived process per vLLM configuration, run by
.venv-vllm/bin/python (no hybridspec needed), with vLLM's engine in-process.

argv[1] is a JSON object: {"model": HF_DIR, "max_model_len": N, "speculative_config": {...} | null}. The worker loads
the model, warms it up and prints `@@ready {"load_s": ...}` (or `@@error {...}` and exits 3). Then it reads requests,
one JSON line each on stdin, {"trajectories": [[prompt token ids, ...], ...], "max_tokens": N, "concurrency": C}:
the trajectories' calls are replayed as C agents would make them (each trajectory's calls one after the other, C
trajectories at a time, the next call added to the engine as soon as the previous one of its trajectory finished),
and it prints `@@result {"calls": [[per call: tokens, ttft_s, total_s, steps, finish_reason], ...], "wall_s": ...}`.

Greedy (`temperature=0`), prefix caching on. Times are measured around `LLMEngine.step()`: a call starts when it is
added and has its first token when the step that produced it returns; `steps` counts the engine steps that gave the
request new tokens (the prefill step that samples the first token included, prefill chunks that sample none not).
"""
from __future__ import annotations

import json
import sys
import time

MARK = "@@"


def reply(kind: str, payload: dict) -> None:
    # vLLM logs to stdout too: the parent reads only lines that start with the mark
    print(f"{MARK}{kind} {json.dumps(payload)}", flush=True)


def replay(engine, params, trajectories: list[list[list[int]]], concurrency: int) -> dict:
    """Closed-loop replay: `concurrency` trajectories live at a time, each with at most one call in the engine."""
    results: list[list[dict | None]] = [[None] * len(calls) for calls in trajectories]
    live: dict[str, dict] = {}
    waiting = list(range(len(trajectories)))[::-1]  # trajectories not started yet, popped from the end

    def add(t: int, i: int) -> None:
        rid = f"t{t}-c{i}-{time.monotonic_ns()}"
        state = {"t": t, "i": i, "start": time.perf_counter(), "first": None, "steps": 0, "n": 0}
        live[rid] = state
        given = engine.add_request(rid, {"prompt_token_ids": trajectories[t][i]}, params)
        if given and given != rid:  # some versions return the id they track the request under
            live[given] = state

    started = time.perf_counter()
    while waiting and len(live) < concurrency:
        add(waiting.pop(), 0)
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            state = live.get(out.request_id)
            if state is None:
                continue
            completion = out.outputs[0]
            if len(completion.token_ids) > state["n"]:
                state["n"] = len(completion.token_ids)
                state["steps"] += 1
                if state["first"] is None:
                    state["first"] = now
            if out.finished:
                for key in [k for k, v in live.items() if v is state]:
                    del live[key]
                t, i = state["t"], state["i"]
                results[t][i] = {"tokens": list(completion.token_ids), "finish_reason": completion.finish_reason,
                                 "ttft_s": (state["first"] or now) - state["start"], "total_s": now - state["start"],
                                 "steps": state["steps"]}
                if i + 1 < len(trajectories[t]):
                    add(t, i + 1)
                elif waiting:
                    add(waiting.pop(), 0)
    return {"calls": results, "wall_s": time.perf_counter() - started}


def set_threads(torch, n: int) -> None:
    """torch's intra-op threads, for real: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op once it
    starts, and its n-gram proposer (numba) leaves torch at 2 threads here; the C++ setter still works."""
    torch._C.set_num_threads(n)
    if torch.get_num_threads() != n:
        raise RuntimeError(f"torch runs {torch.get_num_threads()} threads, {n} were asked for")


def main() -> int:
    config = json.loads(sys.argv[1])
    started = time.perf_counter()
    try:
        import torch
        from vllm import LLM, SamplingParams

        set_threads(torch, config.get("threads", 1))  # one thread, as every other method of the benchmark

        llm = LLM(model=config["model"], dtype="float32", enforce_eager=True, max_model_len=config["max_model_len"],
                  enable_prefix_caching=True, speculative_config=config.get("speculative_config"), seed=0)
        engine = llm.llm_engine
        set_threads(torch, config.get("threads", 1))  # vLLM's CPU worker sets its own count while it starts
        # a short untimed request whose prompt repeats, so that the proposers draft: first-call costs (kernels, the
        # n-gram proposer's numba compilation) stay out of the timings
        llm.generate([{"prompt_token_ids": list(range(100, 132)) * 3}], SamplingParams(temperature=0.0, max_tokens=16),
                     use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - the parent reports why a configuration did not run
        reply("error", {"error": f"{type(e).__name__}: {e}"})
        return 3
    reply("ready", {"load_s": time.perf_counter() - started, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        set_threads(torch, config.get("threads", 1))  # again: the n-gram proposer's numba set-up changes it
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
        result = replay(engine, params, request["trajectories"], request.get("concurrency", 1))
        reply("result", {**result, "threads": torch.get_num_threads()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
