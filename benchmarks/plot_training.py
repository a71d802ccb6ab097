"""Acceptance against training: every checkpoint's held-out acceptance at each evaluation of its run (train_log.json's
history) against the real slots (target tokens) it had trained on by then; a table, JSON and a plot.

    python benchmarks/plot_training.py --json out/training.json
    python benchmarks/plot_training.py --extra out/ablations/fasteagle-no-cascade --json out/ablations.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import REPO, write_json

CHECKPOINTS = REPO / "speculators" / "checkpoints"


def curve(log: dict, k: int) -> list[tuple[int, float]]:
    """(slots trained on, held-out acceptance@k) at each evaluation that recorded its slots."""
    return [(h["slots"], h["eval"][f"acceptance@{k}"]) for h in log["history"]
            if "slots" in h and f"acceptance@{k}" in h.get("eval", {})]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the curves here (and a plot beside it)")
    parser.add_argument("--extra", action="append", type=Path, default=[], help="another checkpoint directory")
    parser.add_argument("--k", type=int, default=7, help="the draft length whose acceptance is plotted")
    args = parser.parse_args(argv)
    dirs = sorted(p for p in CHECKPOINTS.iterdir() if (p / "train_log.json").is_file()) + args.extra
    curves: dict[str, list[tuple[int, float]]] = {}
    for d in dirs:
        log_file = d / "train_log.json"
        if not log_file.is_file():
            parser.error(f"{d}: no train_log.json")
        points = curve(json.loads(log_file.read_text()), args.k)
        if points:
            curves[d.name] = points
        else:
            print(f"{d.name}: its log records no slots per evaluation (trained before they were logged)",
                  file=sys.stderr)
    print(f"held-out acceptance@{args.k} (tokens per step, chains) against real slots trained on")
    for name, points in curves.items():
        print(f"{name:<32}" + "  ".join(f"{slots / 1e3:.0f}k: {acc:.3f}" for slots, acc in points))
    write_json(args.json, {"k": args.k, "curves": curves})
    if args.json and curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name, points in curves.items():
            ax.plot([s for s, _ in points], [a for _, a in points], marker="o", label=name)
        ax.set_xlabel("real slots (target tokens) trained on")
        ax.set_ylabel(f"held-out acceptance@{args.k} (tokens/step)")
        ax.set_title("Drafter acceptance against training (SmolLM2, CPU)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.json.with_suffix(".png"), dpi=120)
        print(f"wrote {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
