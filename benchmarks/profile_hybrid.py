"""Where a decode step's time goes in the engine: the suffix + drafter hybrid against the suffix cache alone, on real
agent calls.

Each method runs on its own Engine (one target model, the machine's cost tables), the calls interleaved method by
method, greedy, prefix caching on. From the engines' cumulative `GenerationStats`: decode steps, tokens per step, and
per step the ms spent proposing (the suffix cache, the router and, for the hybrid, the drafter's catch-up and draft),
verifying (the target's pass over the last token and the draft, and the acceptance rule) and updating; how often the
hybrid ran its drafter, which source won each step, and the tokens each source's drafts added. The last lines split
the hybrid's difference in decode time per token into what its drafter costs, what its longer drafts cost to
verify, and what its extra accepted tokens save.

    python benchmarks/profile_hybrid.py --json out/profile_hybrid.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from agent_calls import load_replay
from common import TRACES_DIR, machine_info, write_json

METHODS = ("suffix", "suffix+peagle")


def profile(stats) -> dict:
    steps = max(1, stats.steps)
    return {"calls": stats.calls, "new_tokens": stats.new_tokens, "steps": stats.steps,
            "tokens_per_step": round(stats.tokens_per_step, 3), "decode_tok_s": round(stats.decode_tokens_per_s, 3),
            "propose_ms_per_step": round(1000 * stats.propose_s / steps, 3),
            "verify_ms_per_step": round(1000 * stats.verify_s / steps, 3),
            "update_ms_per_step": round(1000 * stats.update_s / steps, 3),
            "draft_tokens_per_step": round(stats.draft_tokens / steps, 3),
            "drafter_runs_per_step": round(stats.drafter_runs / steps, 3),
            "prefill_s": round(stats.prefill_s, 3),
            "by_source": {name: {"won": s.won, "drafts": s.drafts, "draft_tokens": s.draft_tokens,
                                 "accepted_tokens": s.accepted_tokens} for name, s in stats.by_source.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--traces", type=Path, default=TRACES_DIR)
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--calls-per-trajectory", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS), help="speculate= names, the first is the baseline")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if len(methods) < 2:
        parser.error("--methods: a baseline and at least one method to compare with it")
    torch.set_num_threads(args.threads)
    from hybridspec import Engine
    from hybridspec.model.target import TargetModel

    model_dir, tokenizer, trajectories = load_replay(args.model, args.trajectories, args.calls_per_trajectory,
                                                     args.max_new_tokens, args.traces, f"methods: {', '.join(methods)}")
    target = TargetModel.from_pretrained(model_dir)
    engines = {m: Engine(target, tokenizer) for m in methods}
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    started = time.perf_counter()
    for calls in trajectories:
        for call in calls:
            for method, engine in engines.items():
                result = engine.generate(call.prompt_token_ids, max_new_tokens=args.max_new_tokens, speculate=method)
                outputs[method].append(result.token_ids)
    rows = {m: profile(e.stats) for m, e in engines.items()}
    base = methods[0]
    identical_calls = {m: sum(a == b for a, b in zip(outputs[m], outputs[base])) for m in methods}
    print(f"{'method':<18}{'decode tok/s':>13}{'tok/step':>9}{'propose':>9}{'verify':>8}{'update':>8}"
          f"{'draft tok':>10}{'drafter':>8}  (ms and counts per step)")
    for m, r in rows.items():
        print(f"{m:<18}{r['decode_tok_s']:>13.2f}{r['tokens_per_step']:>9.2f}{r['propose_ms_per_step']:>9.2f}"
              f"{r['verify_ms_per_step']:>8.2f}{r['update_ms_per_step']:>8.2f}{r['draft_tokens_per_step']:>10.2f}"
              f"{r['drafter_runs_per_step']:>8.2f}")
    for m, r in rows.items():
        won = ", ".join(f"{name} {s['won']} steps ({s['accepted_tokens']} accepted)" for name, s in
                        r["by_source"].items())
        print(f"{m}: {won}; {identical_calls[m]}/{len(outputs[m])} outputs identical to {base}'s")
    split = {}
    b = rows[base]
    for m in methods[1:]:
        r = rows[m]
        # decode ms per token = (propose + verify + update) ms per step / tokens per step
        per_token = {k: r[f"{k}_ms_per_step"] / r["tokens_per_step"] - b[f"{k}_ms_per_step"] / b["tokens_per_step"]
                     for k in ("propose", "verify", "update")}
        split[m] = {f"{k}_ms_per_token": round(v, 3) for k, v in per_token.items()}
        split[m]["decode_ms_per_token"] = round(1000 / r["decode_tok_s"] - 1000 / b["decode_tok_s"], 3)
        print(f"{m} against {base}, decode ms per token: {split[m]['decode_ms_per_token']:+.2f} = proposing "
              f"{per_token['propose']:+.2f} (its drafter) + verifying {per_token['verify']:+.2f} (longer drafts, "
              f"fewer steps) + updating {per_token['update']:+.2f}")
    write_json(args.json, {"methods": rows, "difference": split, "identical_calls": identical_calls,
                           "calls": sum(len(c) for c in trajectories),
                           "wall_s": round(time.perf_counter() - started, 1),
                           "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "machine": machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
