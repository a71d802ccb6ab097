"""A mixed deployment on SmolLM2: real agent calls, held-out MT-Bench questions and HumanEval prompts interleaved as
one server would see them, each method on its own long-lived Engine; whole-call tokens/s per workload and overall.

The requests, in order: an agent call (consecutive logged calls of --trajectories trajectories of
../shared/agent_traces, as `bench_agent_calls.py` replays them: stateless, the whole conversation re-sent), a chat
question (MT-Bench first turns the drafter recipe held out of training), a code prompt (HumanEval prompts the recipe
never trained on), an agent call, ... Every method runs a request before the next one starts, the methods taking turns
in a rotating order (load from other processes falls on all alike); each keeps its caches across requests, as a server
would. Greedy, --max-new-tokens, one CPU thread. tok/s = generated tokens over the summed whole-call times, prefill
included; "identical" compares every request's tokens with speculate="none".

Target (issue 23): the hybrid (suffix+peagle) >= 1.15x the better of suffix and peagle overall.

    python benchmarks/bench_mixed.py --json out/bench_mixed.json
    python benchmarks/bench_mixed.py --methods none,suffix,fasteagle,suffix+fasteagle --json out/bench_mixed_fe.json
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from agent_calls import load_replay
from bench_e2e import chat_questions, code_prompts
from common import REPO, TRACES_DIR, WORKLOADS_DIR, bar_plot, machine_info, write_json

RECIPE = REPO / "speculators" / "recipes" / "peagle-smollm2.yaml"  # its held-out prompts (the heads share the data)
HYBRID, HALVES, TARGET = "suffix+peagle", ("suffix", "peagle"), 1.15


@dataclass
class Request:
    workload: str                            # "agent", "chat" or "code"
    name: str
    prompt: list[int] | list[dict[str, str]]  # token ids (agent calls, as logged) or messages


def mixed_requests(agent: list[Request], chat: list[Request], code: list[Request]) -> list[Request]:
    """agent, chat, code, agent, chat, code, ...; what is left of the longer lists at the end."""
    return [r for group in zip_longest(agent, chat, code) for r in group if r is not None]


def summarize(runs: list[dict[str, Any]], reference: dict[str, list[int]]) -> dict[str, Any]:
    tokens = sum(len(r["tokens"]) for r in runs)
    seconds = sum(r["total_s"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    return {"tok_s": round(tokens / seconds, 3) if seconds else 0.0, "requests": len(runs), "new_tokens": tokens,
            "total_s": round(seconds, 3), "tokens_per_step": round(tokens / steps, 3) if steps else None,
            "identical": sum(r["tokens"] == reference[r["name"]] for r in runs),
            "drafter_runs": sum(r["drafter_runs"] for r in runs)}


def plot(path: Path, table: dict[str, dict[str, dict]], methods: list[str]) -> Path | None:
    series = {m: {w: per_method[m]["tok_s"] for w, per_method in table.items()} for m in methods}
    return bar_plot(path, list(table), series, "whole-call tokens/s",
                    "SmolLM2 on CPU, greedy: tokens/s by workload and method")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (and a plot beside it)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--methods", default="none,suffix,peagle,suffix+peagle",
                        help="comma-separated speculate= values; none is always run (the reference)")
    parser.add_argument("--trajectories", type=int, default=2)
    parser.add_argument("--calls-per-trajectory", type=int, default=4)
    parser.add_argument("--chat", type=int, default=8, help="held-out MT-Bench questions")
    parser.add_argument("--code", type=int, default=8, help="HumanEval prompts the recipe never trained on")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--heldout-recipe", type=Path, default=RECIPE)
    parser.add_argument("--traces", type=Path, default=TRACES_DIR)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from hybridspec import Engine
    from hybridspec.runtime.engine import SPECULATE_CHOICES
    from hybridspec.model.target import TargetModel

    methods = ["none"] + [m for m in dict.fromkeys(args.methods.split(",")) if m and m != "none"]
    bad = [m for m in methods if m not in SPECULATE_CHOICES]
    if bad:
        parser.error(f"--methods: unknown {bad}; choose from {SPECULATE_CHOICES}")

    torch.set_num_threads(args.threads)
    model_dir, tokenizer, trajectories = load_replay(args.model, args.trajectories, args.calls_per_trajectory,
                                                     args.max_new_tokens, args.traces, f"methods: {', '.join(methods)}")
    agent = [Request("agent", f"{c.trajectory}#{c.index}", c.prompt_token_ids) for calls in trajectories
             for c in calls]
    chat = [Request("chat", f"mt_bench#{i}", [{"role": "user", "content": q}])
            for i, q in enumerate(chat_questions(WORKLOADS_DIR / "mt_bench_questions.jsonl", args.chat,
                                                 args.heldout_recipe))]
    code = [Request("code", f"humaneval#{i}", [{"role": "user", "content": p}])
            for i, p in enumerate(code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", args.code, args.heldout_recipe))]
    requests = mixed_requests(agent, chat, code)

    target = TargetModel.from_pretrained(model_dir)
    engines = {m: Engine(target, tokenizer) for m in methods}
    for method, engine in engines.items():  # untimed: load the drafters, warm the kernels
        engine.generate([{"role": "user", "content": "Hello"}], max_new_tokens=4, speculate=method)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    started = time.perf_counter()
    with tqdm(total=len(requests) * len(methods), desc="requests x methods", unit="call", disable=None) as progress:
        for k, request in enumerate(requests):
            for method in methods[k % len(methods):] + methods[:k % len(methods)]:
                begin = time.perf_counter()
                result = engines[method].generate(request.prompt, max_new_tokens=args.max_new_tokens,
                                                  speculate=method)
                runs[method].append({"workload": request.workload, "name": request.name,
                                     "tokens": result.token_ids, "total_s": time.perf_counter() - begin,
                                     "steps": result.stats.steps, "drafter_runs": result.stats.drafter_runs})
                progress.update(1)
    reference = {r["name"]: r["tokens"] for r in runs["none"]}
    table: dict[str, dict[str, dict]] = {}
    for workload in ("agent", "chat", "code", "mixed"):
        table[workload] = {m: summarize([r for r in rs if workload in ("mixed", r["workload"])], reference)
                           for m, rs in runs.items()}
        base = table[workload]["none"]["tok_s"]
        for s in table[workload].values():
            s["vs_none"] = round(s["tok_s"] / base, 3) if base else None

    print(f"\n{len(requests)} requests ({len(agent)} agent calls, {len(chat)} chat, {len(code)} code), "
          f"{args.max_new_tokens} new tokens, greedy")
    print(f"{'workload':<9}{'method':<20}{'tok/s':>8}{'vs none':>9}{'tokens/step':>13}{'drafter runs':>14}"
          f"{'identical':>11}")
    for workload, per_method in table.items():
        for method, s in per_method.items():
            print(f"{workload:<9}{method:<20}{s['tok_s']:>8.2f}{s['vs_none']:>8.2f}x"
                  f"{s['tokens_per_step'] or 0:>13.2f}{s['drafter_runs']:>14}{s['identical']:>6}/{s['requests']}")
    goal = None
    if HYBRID in table["mixed"] and all(h in table["mixed"] for h in HALVES):
        better = max(HALVES, key=lambda h: table["mixed"][h]["tok_s"])
        ratio = table["mixed"][HYBRID]["tok_s"] / table["mixed"][better]["tok_s"]
        goal = {"ratio": round(ratio, 3), "better_half": better, "target": TARGET, "pass": ratio >= TARGET}
        print(f"target: {HYBRID} / {better} = {ratio:.2f}x >= {TARGET}x: {'ok' if goal['pass'] else 'MISS'}")
    result = {"workloads": table, "target": goal, "requests": [(r.workload, r.name) for r in requests],
              "wall_s": round(time.perf_counter() - started, 1),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": machine_info()}
    write_json(args.json, result)
    if args.json:
        png = plot(args.json, table, methods)
        if png:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
