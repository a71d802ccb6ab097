"""`hybridspec replay`: what speculative decoding would buy on recorded agent traffic, per proposer."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridspec.agent_traces.formats import TraceFormatError, load_traces
from hybridspec.agent_traces.replay import PROPOSER_NAMES, arctic_available, proposer_spec, replay
from hybridspec.router import VerifyCost
from hybridspec.agent_traces.report import ReplayReport
from hybridspec.agent_traces.tokenization import TraceTokenizer



def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay", help="replay agent logs through proposers with the logged responses as the oracle",
        description=__doc__ + " Formats: SWE-agent .traj, mini-swe-agent .traj.json, AutoCodeRover task "
                              "directories, generic JSONL (see hybridspec.agent_traces.formats).")
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="trace files or directories (searched recursively)")
    p.add_argument("--proposer", default=None,
                   help=f"comma-separated, from {', '.join(PROPOSER_NAMES)} (default: suffix,ngram, and arctic-suffix "
                        "when arctic_inference is importable)")
    p.add_argument("--num-speculative-tokens", type=int, default=16,
                   help="draft tokens per step at most (default 16)")
    p.add_argument("--tree", action="store_true",
                   help="suffix and arctic-suffix draft token trees of at most --num-speculative-tokens nodes (one "
                        "pass verifies them all); a step accepts the longest path that matches the response")
    p.add_argument("--json", type=Path, help="write the metrics here")
    p.add_argument("--plot", type=Path, help="write a PNG comparing the proposers here")
    p.add_argument("--skip-bad", action="store_true", help="pass over malformed files and count them")
    p.add_argument("--tokenizer", default="smollm2",
                   help="local Hugging Face tokenizer directory, or a model name (default: the embedded SmolLM2)")
    p.add_argument("--cost-table", type=Path,
                   help="JSON {k: ms} of the target's verification cost with k draft tokens, or the output of "
                        "`python benchmarks/bench_verify_cost.py --json PATH` (default: SmolLM2-135M on "
                        "a 2-core CPU)")
    p.add_argument("--cache-dir", type=Path, help="tokenisation cache (default: ~/.cache/hybridspec/agent_traces)")
    p.add_argument("--no-cache", action="store_true", help="tokenise again and do not write the cache")
    g = p.add_argument_group("suffix proposer settings (hybridspec.suffix.SuffixCache)")
    g.add_argument("--suffix-max-depth", type=int, default=64)
    g.add_argument("--suffix-max-spec-factor", type=float, default=1.0)
    g.add_argument("--suffix-max-spec-offset", type=float, default=0.0)
    g.add_argument("--suffix-min-token-prob", type=float, default=0.1)
    g = p.add_argument_group("arctic-suffix proposer settings (hybridspec.tools.peers.ArcticSuffixProposer)")
    g.add_argument("--arctic-max-depth", type=int, default=64, help="64: ArcticInference's default; vLLM uses 24")
    p.set_defaults(func=run)


def _proposer_names(arg: str | None) -> list[str]:
    if arg is None:
        return ["suffix", "ngram"] + (["arctic-suffix"] if arctic_available() else [])
    names = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROPOSER_NAMES]
    if unknown or not names:
        raise ValueError(f"--proposer: unknown {unknown or 'empty list'}; choose from {', '.join(PROPOSER_NAMES)}")
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace) -> int:
    try:
        names = _proposer_names(args.proposer)
        cost = VerifyCost.load(args.cost_table) if args.cost_table else VerifyCost()
        options = {
            "suffix": dict(max_depth=args.suffix_max_depth, max_spec_factor=args.suffix_max_spec_factor,
                           max_spec_offset=args.suffix_max_spec_offset, min_token_prob=args.suffix_min_token_prob),
            "ngram": {},
            "arctic-suffix": dict(max_depth=args.arctic_max_depth),
        }
        specs = [proposer_spec(n, args.num_speculative_tokens, tree=args.tree, **options[n]) for n in names]
        loaded = load_traces(args.paths, skip_bad=args.skip_bad)
        trajectories = loaded.trajectories
        if not any(t.calls for t in trajectories):
            raise TraceFormatError(args.paths[0], "no LLM calls to replay")
        n_calls = sum(len(t.calls) for t in trajectories)
        print(f"{n_calls:,} calls in {len(trajectories):,} trajectories from {len(loaded.sources):,} sources"
              + (f" ({len(loaded.skipped)} bad files skipped)" if loaded.skipped else ""), file=sys.stderr)
        tokenizer = TraceTokenizer(args.tokenizer, cache_dir=args.cache_dir, use_cache=not args.no_cache)
        tokenized = tokenizer.tokenize(loaded.sources)
    except (TraceFormatError, ValueError, FileNotFoundError, ImportError) as e:
        print(f"hybridspec replay: error: {e}", file=sys.stderr)
        return 2
    results = replay(tokenized, specs, args.num_speculative_tokens)
    report = ReplayReport(results, cost, args.num_speculative_tokens, loaded.skipped)
    print(report.format_table())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        report.plot(args.plot, cost_label=args.cost_table.name if args.cost_table else "SmolLM2-135M, CPU")
    return 0
