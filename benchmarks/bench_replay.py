"""Replay the real agent traces (../shared/agent_traces) through suffix, n-gram and ArcticInference at equal budgets.

For each num_speculative_tokens K (16 and 32) every proposer replays the whole development set in one run, taking turns
call by call (hybridspec.agent_traces.replay): hybridspec's SuffixCache, NgramProposer, and the peer's suffix decoding
at its own default depth (64) and at vLLM's (24). Printed: the replay table per K, the proposal time per speculate call
(median, p99 and mean; the JSON adds `us_per_speculate_mean` to the report's metrics), the issue's targets as ratios per
framework (suffix >= 1.15x Arctic's tokens per step and >= n-gram's; suffix proposal time per speculate call, median and
mean, <= 0.5x Arctic's), and each proposer's wall time for the whole set (target: < 5 minutes).

    .venv-peers/bin/python benchmarks/bench_replay.py --json out/bench_replay.json   # all proposers
    .venv/bin/python benchmarks/bench_replay.py                                       # suffix and n-gram only
    .venv-peers/bin/python benchmarks/bench_replay.py --tree --json out/bench_replay_tree.json   # token trees

The peers' environment has no transformers: there the traces are tokenised (or found in the tokenisation cache) by
the project's interpreter (.venv/bin/python, or --tokenize-python) in a subprocess, and read back from the cache.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import REPO, TRACES_DIR, machine_info, write_json
from hybridspec.agent_traces import ReplayReport, ReplayStats, TraceTokenizer, load_traces, proposer_spec, replay
from hybridspec.agent_traces.replay import arctic_available
from hybridspec.router import VerifyCost

TARGET_VS_ARCTIC_TOKENS = 1.15
TARGET_VS_ARCTIC_TIME = 0.5
TARGET_WALL_S = 300.0
# label -> (proposer, constructor options); arctic-suffix (the ArcticInference peer) at its default depth and vLLM's
CONFIGS = {
    "suffix": ("suffix", {}),
    "ngram": ("ngram", {}),
    "arctic-suffix": ("arctic-suffix", {"max_depth": 64}),
    "arctic-suffix-vllm": ("arctic-suffix", {"max_depth": 24}),
}


def _tokenizer(args: argparse.Namespace) -> TraceTokenizer:
    """The tokenizer, resolved in-process when transformers is importable, else through the project's interpreter,
    which tokenises into the cache and tells us where the tokenizer and the cache are."""
    if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None:
        return TraceTokenizer(args.tokenizer)
    cmd = [args.tokenize_python, str(Path(__file__).resolve()), "--prepare-tokens", "--tokenizer", args.tokenizer,
           "--traces", *map(str, args.traces)]
    print(f"tokenising with {args.tokenize_python} (no transformers here)", file=sys.stderr)
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    where = json.loads(done.stdout.strip().splitlines()[-1])
    return TraceTokenizer(where["tokenizer_dir"], cache_dir=where["cache_dir"])


def _prepare_tokens(args: argparse.Namespace) -> int:
    tok = TraceTokenizer(args.tokenizer)
    tok.tokenize(load_traces(args.traces).sources)
    print(json.dumps({"tokenizer_dir": str(tok.directory), "cache_dir": str(tok.cache_dir)}))
    return 0


def _targets(results: dict, labels: list[str]) -> dict[str, dict[str, float]]:
    """Per framework (and overall): the ratios the issue sets targets on."""
    sections = {fw: {p: results[p][fw] for p in labels} for fw in results[labels[0]]}
    sections["overall"] = {p: ReplayStats.merge(list(results[p].values())) for p in labels}
    out = {}
    for fw, stats in sections.items():
        if "suffix" not in stats:
            continue
        tps = {p: s.response_tokens / s.steps for p, s in stats.items()}
        row = {}
        if "ngram" in stats:
            row["suffix_vs_ngram_tokens_per_step"] = tps["suffix"] / tps["ngram"]
        for arctic in (p for p in labels if p.startswith("arctic-suffix")):
            row[f"suffix_vs_{arctic}_tokens_per_step"] = tps["suffix"] / tps[arctic]
            for name, f in (("p50", np.median), ("mean", np.mean)):
                row[f"suffix_vs_{arctic}_speculate_time_{name}"] = (f(stats["suffix"].speculate_ns)
                                                                   / f(stats[arctic].speculate_ns))
        out[fw] = row
    return out


def _add_mean_speculate_time(data: dict, report: ReplayReport) -> None:
    """The mean proposal time per call next to the report's median and p99: the target is on the mean as well, and
    the mean is what a heavy tail shows in."""
    for fw, per in list(data["frameworks"].items()) + [(None, data["overall"])]:
        for p, metrics in per.items():
            stats = report.overall(p) if fw is None else report.results[p][fw]
            metrics["us_per_speculate_mean"] = float(np.mean(stats.speculate_ns)) / 1e3 if stats.steps else 0.0


def _print_speculate_times(data: dict) -> None:
    sections = list(data["frameworks"].items()) + [("overall", data["overall"])]
    print(f"{'speculate µs p50 / p99 / mean':<32}" + "".join(f"{fw:>24}" for fw, _ in sections))
    for p in data["overall"]:
        cells = [(f"{m['us_per_speculate_p50']:.1f} / {m['us_per_speculate_p99']:.1f} / "
                  f"{m['us_per_speculate_mean']:.1f}") if (m := per.get(p)) else "-" for _, per in sections]
        print(f"{p:<32}" + "".join(f"{c:>24}" for c in cells))


def _print_targets(targets: dict[str, dict[str, float]]) -> None:
    def mark(key: str, value: float) -> str:
        if key.endswith("_tokens_per_step"):
            ok = value >= (1.0 if "ngram" in key else TARGET_VS_ARCTIC_TOKENS)
        else:
            ok = value <= TARGET_VS_ARCTIC_TIME
        return f"{value:.3f} {'ok' if ok else 'MISS'}"

    keys = list(dict.fromkeys(k for row in targets.values() for k in row))
    goals = {k: (">= 1.00" if "ngram" in k else f">= {TARGET_VS_ARCTIC_TOKENS:.2f}") if k.endswith("_tokens_per_step")
             else f"<= {TARGET_VS_ARCTIC_TIME:.2f}" for k in keys}
    width = max(len(k) for k in keys)
    print(f"{'target ratio':<{width}} {'goal':>8}" + "".join(f"{fw:>18}" for fw in targets))
    for k in keys:
        print(f"{k:<{width}} {goals[k]:>8}" + "".join(f"{mark(k, row[k]) if k in row else '-':>18}"
                                                       for row in targets.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--traces", type=Path, nargs="+", default=[TRACES_DIR])
    ap.add_argument("--num-speculative-tokens", default="16,32", help="comma-separated budgets K")
    ap.add_argument("--tree", action="store_true",
                    help="suffix and arctic-suffix draft token trees of at most K nodes (n-gram: chains)")
    ap.add_argument("--proposers", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    ap.add_argument("--tokenizer", default="smollm2")
    ap.add_argument("--tokenize-python", default=str(REPO / ".venv" / "bin" / "python"),
                    help="interpreter with transformers, used when this one has none")
    ap.add_argument("--prepare-tokens", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prepare_tokens:
        return _prepare_tokens(args)

    labels = [p for p in args.proposers.split(",") if p]
    unknown = [p for p in labels if p not in CONFIGS]
    if unknown:
        ap.error(f"unknown proposers {unknown}; choose from {', '.join(CONFIGS)}")
    if not arctic_available() and any(CONFIGS[p][0] == "arctic-suffix" for p in labels):
        print("arctic_inference is not importable here: skipping the Arctic proposers "
              "(run under .venv-peers/bin/python, made by scripts/setup_peers.sh)", file=sys.stderr)
        labels = [p for p in labels if CONFIGS[p][0] != "arctic-suffix"]
    budgets = [int(k) for k in args.num_speculative_tokens.split(",")]

    t0 = time.perf_counter()
    loaded = load_traces(args.traces)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenized = _tokenizer(args).tokenize(loaded.sources)
    tokenize_s = time.perf_counter() - t0
    n_calls = sum(len(t.calls) for t in tokenized)
    print(f"{n_calls:,} calls in {len(tokenized)} trajectories; load {load_s:.1f} s, tokenise {tokenize_s:.1f} s")

    cost = VerifyCost()
    runs = {}
    for k in budgets:
        specs = [proposer_spec(CONFIGS[p][0], k, label=p, tree=args.tree, **CONFIGS[p][1]) for p in labels]
        results = replay(tokenized, specs, k)
        report = ReplayReport(results, cost, k)
        data = report.to_json()
        _add_mean_speculate_time(data, report)
        wall = {p: sum(s.wall_ns for s in results[p].values()) / 1e9 for p in labels}
        indexing = {p: sum(s.start_ns for s in results[p].values()) / 1e9 for p in labels}
        targets = _targets(results, labels)
        print()
        print(report.format_table())
        print()
        _print_speculate_times(data)
        print(f"\nwall time for the whole set (target < {TARGET_WALL_S:.0f} s per proposer): "
              + ", ".join(f"{p} {s:.1f} s (prompt indexing {indexing[p]:.1f} s)" for p, s in wall.items()))
        if any(targets.values()):
            print(f"\ntargets at num_speculative_tokens {k}:")
            _print_targets(targets)
        runs[str(k)] = {**data, "wall_s": wall, "prompt_indexing_s": indexing, "targets": targets}

    write_json(args.json, {
        "traces": [str(p) for p in args.traces], "calls": n_calls, "tokenizer": args.tokenizer, "tree": args.tree,
        "proposers": {p: {"proposer": CONFIGS[p][0], **CONFIGS[p][1]} for p in labels},
        "verify_cost_ms": cost.table(), "load_s": load_s, "tokenize_s": tokenize_s,
        "machine": machine_info(), "python": sys.executable,
        "runs": runs,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
