"""A mixed deployment on SmolLM2: real agent calls, held-out MT-Bench questions and HumanEval prompts interleaved as
one server would see them, each method on its own long-lived Engine; whole-call tokens/s per workload and overall.

The requests, in order: an agent call (consecutive logged calls of --trajectories trajectories of
../shared/agent_traces, as `bench_agent_calls.py` replays them: stateless, the whole conversation re-sent), a chat
question (MT-Bench first turns the drafter recipe held out of training), a code prompt (HumanEval prompts the recipe
never trained on), an agent call, ... Every method runs a request before the next one starts, the methods taking turns
in a rotating order (load from other processes falls on all alike); each keeps its caches across requests, as a server
would. Greedy, --max-new-tokens, one CPU thread. The summaries and JSON are harness.py's, per workload (agent, chat,
code) and overall: tok_s = generated tokens over the summed whole-call times, prefill included; vs_none = tok_s over
speculate="none"'s; identical_calls compares every request's tokens with speculate="none"'s.

Target: the hybrid (suffix+peagle) >= 1.15x the better of suffix and peagle overall.

    python benchmarks/bench_mixed.py --json out/bench_mixed.json
    python benchmarks/bench_mixed.py --methods none,suffix,fasteagle,suffix+fasteagle --json out/bench_mixed_fe.json
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch

from agent_calls import AgentCall, load_replay, prompt_calls
from bench_e2e import chat_questions, code_prompts
from common import REPO, TRACES_DIR, WORKLOADS_DIR
from harness import (IDENTICAL, METHOD, OVERALL, TOK_S, TOKENS_PER_STEP, WORKLOAD, Column, add_level, add_ratio,
                     by_method, engine_call, interleave, print_table, print_targets, ratio_column,
                     reference_outputs, report, rows, summarize_runs, target, warmup_call, write)

RECIPE = REPO / "speculators" / "recipes" / "peagle-smollm2.yaml"  # its held-out prompts (the heads share the data)
HYBRID, HALVES, TARGET = "suffix+peagle", ("suffix", "peagle"), 1.15
DRAFTER_RUNS = Column("drafter runs", 14, lambda row: str(row["engine"]["drafter_runs"]))
COLUMNS = (WORKLOAD, METHOD, TOK_S, ratio_column("vs_none", "vs none"), TOKENS_PER_STEP, DRAFTER_RUNS, IDENTICAL)


def mixed_calls(agent: list[AgentCall], chat: list[AgentCall], code: list[AgentCall]) -> list[AgentCall]:
    """agent, chat, code, agent, chat, code, ...; what is left of the longer lists at the end."""
    return [c for group in zip_longest(agent, chat, code) for c in group if c is not None]


def targets(overall: dict[str, dict]) -> dict[str, Any]:
    """The hybrid against the better of its halves, over every request; none unless all three ran."""
    if HYBRID not in overall or not all(h in overall for h in HALVES):
        return {}
    better = max(HALVES, key=lambda h: overall[h]["tok_s"])
    return {"hybrid_vs_better_half": target(overall[HYBRID], overall[better], TARGET, better_half=better)}


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
    from hybridspec.model.target import TargetModel
    from hybridspec.runtime.engine import SPECULATE_CHOICES

    methods = ["none"] + [m for m in dict.fromkeys(args.methods.split(",")) if m and m != "none"]
    bad = [m for m in methods if m not in SPECULATE_CHOICES]
    if bad:
        parser.error(f"--methods: unknown {bad}; choose from {SPECULATE_CHOICES}")

    torch.set_num_threads(args.threads)
    model_dir, tokenizer, trajectories = load_replay(args.model, args.trajectories, args.calls_per_trajectory,
                                                     args.max_new_tokens, args.traces, f"methods: {', '.join(methods)}")
    agent = [replace(c, workload="agent") for calls in trajectories for c in calls]
    chat = prompt_calls("chat", "mt_bench", chat_questions(WORKLOADS_DIR / "mt_bench_questions.jsonl", args.chat,
                                                           args.heldout_recipe), tokenizer)
    code = prompt_calls("code", "humaneval", code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", args.code,
                                                          args.heldout_recipe), tokenizer)
    calls = mixed_calls(agent, chat, code)

    target_model = TargetModel.from_pretrained(model_dir)
    engines = {m: Engine(target_model, tokenizer) for m in methods}
    warmup = warmup_call(tokenizer)
    for method, engine in engines.items():  # untimed: load the drafters, warm the kernels
        engine.generate(warmup.prompt_token_ids, max_new_tokens=4, speculate=method)

    started = time.perf_counter()
    records = interleave({m: engine_call(e, m, max_new_tokens=args.max_new_tokens, speculate=m)
                          for m, e in engines.items()}, calls, desc="requests x methods")
    reference = reference_outputs(records, "none")
    tables = summarize_runs(by_method(records, methods), reference)
    for table in tables.values():
        add_ratio(table, "vs_none", table.get("none"))
    workloads: dict[str, dict[str, dict]] = {}
    add_level(workloads, 1, tables)

    print_table(f"{len(calls)} requests ({len(agent)} agent calls, {len(chat)} chat, {len(code)} code), "
                f"{args.max_new_tokens} new tokens, greedy", rows(tables), COLUMNS)
    goals = targets(tables[OVERALL])
    print_targets(goals)
    result = report(args, started, workloads=workloads, targets=goals, reference="none", outputs=reference,
                    records={1: records})
    write(args.json, result, "SmolLM2 on CPU, greedy: tokens/s by workload and method", by_workload=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
