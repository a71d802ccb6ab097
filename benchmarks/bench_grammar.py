"""What a grammar costs and what speculation under it buys, in-process on the Engine: the tool-calling and JSON-schema
requests of bench_tools.py (real agent calls from ../shared/agent_traces, their actions as `bash` tool calls,
`tool_choice: "required"`; AutoCodeRover's JSON extractions with their schema), the same prompt token ids for every
method (the ChatML tools template).

Methods (one Engine each on one shared target model, so that no suffix or prefix cache serves another method):
- free-none: no grammar, no speculation: the unconstrained decoding of the same prompts;
- grammar-none: the request's grammar, no speculation (plain constrained decoding; the reference);
- grammar-suffix-nogd: the suffix cache's drafts checked against the grammar, without grammar-forced drafts;
- grammar-suffix: the same with the tokens the grammar forces drafted (source "grammar").

The grammar's own cost: `constrained_cost` is grammar-none's decode seconds per token over free-none's, on the same
prompts (the outputs differ where the grammar steers, but a decode step costs the same whichever token it makes;
target: at most 1.05), and `constrained_cost_identical` the same on the calls where both wrote identical tokens (None
where there are none: SmolLM2 seldom writes the call unasked).
Speed: whole-call tok/s, at concurrency 1 (methods interleaved call by call) and 4 (threads on one engine).

JSON: harness.py's keys (reference grammar-none, outputs_compared "tokens"), and `constrained_cost`,
`constrained_cost_identical`, `same_tokens_calls` (calls whose free and constrained outputs are identical).

    nice -n 10 .venv/bin/python benchmarks/bench_grammar.py --json out/bench_grammar.json     # ~15 min here
    .venv/bin/python benchmarks/bench_grammar.py --smoke                                     # ~1 min
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_tools import StructuredCall, chat_template_path, json_calls, tool_calls
from harness import (IDENTICAL, METHOD, OVERALL, TOK_S, TOKENS_PER_STEP, TTFT, CallRecord, add_level, add_ratio,
                     engine_record, interleave, print_table, print_targets, ratio_column, reference_outputs, replay,
                     report, rows, summarize_runs, target, write)

METHODS: dict[str, dict[str, Any]] = {
    "free-none": dict(speculate="none", grammar=False),
    "grammar-none": dict(speculate="none"),
    "grammar-suffix-nogd": dict(speculate="suffix", grammar_drafts=False),
    "grammar-suffix": dict(speculate="suffix"),
}
REFERENCE = "grammar-none"
COST_TARGET = 1.05  # constrained decoding costs at most 5% more per token than unconstrained
SPEEDUP_TARGET = 1.5  # speculation under the grammar over constrained decoding without it


def method_call(engine: Any, method: str) -> Any:
    """`method` on its engine: a call's prompt ids with its grammar (the request's body) unless free."""
    options = dict(METHODS[method])
    grammar = options.pop("grammar", True)

    def run(call: StructuredCall) -> CallRecord:
        start = time.perf_counter()
        result = engine.generate(call.prompt_token_ids, max_new_tokens=call.max_tokens, **options,
                                 **(call.body if grammar else {}))
        return engine_record(method, call, result, time.perf_counter() - start)

    return run


def decode_s_per_token(records: Sequence[CallRecord]) -> float | None:
    tokens = sum(r.new_tokens for r in records)
    return sum(r.stats.decode_s for r in records) / tokens if tokens else None


def constrained_cost(runs: Mapping[str, Sequence[CallRecord]]) -> dict[str, Any]:
    """grammar-none's decode seconds per token over free-none's: on every call both ran, and on those whose tokens are
    the same."""
    free = {r.key: r for r in runs.get("free-none", [])}
    constrained = {r.key: r for r in runs.get("grammar-none", [])}
    same = [k for k in constrained if k in free and free[k].output == constrained[k].output]

    def ratio(keys: Sequence[tuple[str, int]]) -> float | None:
        a, b = decode_s_per_token([constrained[k] for k in keys]), decode_s_per_token([free[k] for k in keys])
        return round(a / b, 3) if a and b else None

    return {"constrained_cost": ratio([k for k in constrained if k in free]), "constrained_cost_identical": ratio(same),
            "same_tokens_calls": len(same)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--trajectories", type=int, default=4, help="tool-calling trajectories (agents)")
    parser.add_argument("--calls-per-trajectory", type=int, default=4)
    parser.add_argument("--json-calls", type=int, default=4, help="JSON-schema requests")
    parser.add_argument("--max-prompt-tokens", type=int, default=3072)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--smoke", action="store_true", help="1 trajectory of 2 calls, 1 JSON call, concurrency 1")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.trajectories, args.calls_per_trajectory, args.json_calls, args.concurrency = 1, 2, 1, "1"
        args.max_prompt_tokens, args.max_tokens = 4096, 48
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown or REFERENCE not in methods:
        parser.error(f"methods are {', '.join(METHODS)} (with {REFERENCE}); got {args.methods}")
    started = time.perf_counter()

    import torch

    from hybridspec import Engine
    from hybridspec.model.loading import load_tokenizer
    from hybridspec.model.target import TargetModel

    torch.set_num_threads(args.threads)
    template = chat_template_path().read_text()
    tokenizer = load_tokenizer("smollm2")
    agents = tool_calls(tokenizer, template, args.trajectories, args.calls_per_trajectory, args.max_prompt_tokens,
                        args.max_tokens)
    agents += [[c] for c in json_calls(tokenizer, template, args.json_calls, args.max_prompt_tokens, args.max_tokens)]
    calls = [c for agent in agents for c in agent]
    target_model = TargetModel.from_pretrained("smollm2")
    levels = [int(c) for c in args.concurrency.split(",")]

    def engines() -> dict[str, Any]:  # fresh caches for every replay
        return {m: Engine(target_model, tokenizer, chat_template=template) for m in methods}

    workloads: dict[str, dict[str, dict]] = {}
    records: dict[int, list[CallRecord]] = {}
    reference: dict = {}
    costs: dict[str, Any] = {}
    for concurrency in levels:
        fresh = engines()
        run = {m: method_call(fresh[m], m) for m in methods}
        for m in methods:  # warm up: kernels, the grammar compiler
            run[m](calls[0])
            fresh[m] = Engine(target_model, tokenizer, chat_template=template)
            run[m] = method_call(fresh[m], m)
        if concurrency == 1:
            got = interleave(run, calls)
            walls = {}
        else:
            got, walls = [], {}
            for m in methods:
                rs, walls[m] = replay(run[m], agents, concurrency, per_thread=lambda: torch.set_num_threads(1))
                got += rs
        records[concurrency] = got
        runs: dict[str, list[CallRecord]] = {m: [r for r in got if r.method == m] for m in methods}
        reference = reference or reference_outputs(got, REFERENCE)
        tables = summarize_runs(runs, reference, concurrency, walls or None)
        for table in tables.values():
            add_ratio(table, "vs_none", table.get(REFERENCE))
        add_level(workloads, concurrency, tables)
        if concurrency == 1:
            costs = constrained_cost(runs)

    cost = costs.get("constrained_cost")
    targets = {}
    if cost:  # as a speed ratio: unconstrained decode time per token over constrained, at least 1 / 1.05
        targets["constrained_cost"] = {"ratio": round(1 / cost, 3), "target": round(1 / COST_TARGET, 3),
                                       "pass": cost <= COST_TARGET, "cost": cost}
    for c in levels:
        table = workloads[OVERALL][f"concurrency-{c}"]
        goal = target(table.get("grammar-suffix"), table.get(REFERENCE), SPEEDUP_TARGET, identical=True)
        if goal:
            targets[f"grammar_suffix_vs_none@{c}"] = goal
    columns = [METHOD, TOK_S, TTFT, TOKENS_PER_STEP, ratio_column("vs_none", "vs none"), IDENTICAL]
    for workload, by_level in workloads.items():
        for name, table in by_level.items():
            print_table(f"{workload}, {name}", rows({workload: table}), columns)
    print(f"constrained decoding's time per token over free decoding's: {costs.get('constrained_cost')} (on the "
          f"{costs.get('same_tokens_calls')} calls of identical tokens: {costs.get('constrained_cost_identical')})")
    print_targets(targets)
    result = report(args, started, workloads=workloads, targets=targets, reference=REFERENCE, outputs=reference,
                    records=records, **costs)
    write(args.json, result, "hybridspec: decoding under a grammar (in-process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
