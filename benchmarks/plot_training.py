"""Acceptance against training: every checkpoint's held-out acceptance at each evaluation of its run (train_log.json's
history) against the real slots (target tokens) it had trained on by then, and each run's final acceptance against the
distinct tokens it trained on (data scaling: the fasteagle-data-* ablations train on shares of the same data for the
same steps); a table, JSON and a plot of both.

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


def final_points(dirs: list[Path], k: int) -> dict[str, dict]:
    """Each run's final held-out acceptance@k, the distinct tokens and the steps it trained on."""
    finals = {}
    for d in dirs:
        log = json.loads((d / "train_log.json").read_text())
        if f"acceptance@{k}" in (log.get("final_eval") or {}):
            finals[d.name] = {"train_tokens": log["train_tokens"], "steps": log["steps"],
                              "acceptance": log["final_eval"][f"acceptance@{k}"]}
    return finals


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
    finals = final_points(dirs, args.k)
    print(f"\nfinal held-out acceptance@{args.k} against the distinct tokens trained on (steps)")
    for name, point in finals.items():
        print(f"{name:<32}{point['train_tokens'] / 1e3:7.0f}k tokens  {point['steps']:5d} steps  "
              f"{point['acceptance']:.3f}")
    write_json(args.json, {"k": args.k, "curves": curves, "final": finals})
    if args.json and curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, data_ax) = plt.subplots(1, 2, figsize=(12, 4.2))
        for name, points in curves.items():
            ax.plot([s for s, _ in points], [a for _, a in points], marker="o", label=name)
        ax.set_xlabel("real slots (target tokens) trained on")
        ax.set_ylabel(f"held-out acceptance@{args.k} (tokens/step)")
        ax.set_title("Drafter acceptance against training (SmolLM2, CPU)")
        ax.legend(fontsize=7)
        for name, point in finals.items():
            data_ax.scatter(point["train_tokens"], point["acceptance"])
            data_ax.annotate(f"{name} ({point['steps']} steps)", (point["train_tokens"], point["acceptance"]),
                             fontsize=7, xytext=(4, 2), textcoords="offset points")
        data_ax.set_xscale("log")
        data_ax.set_xlabel("distinct tokens trained on")
        data_ax.set_ylabel(f"final held-out acceptance@{args.k}")
        data_ax.set_title("Data scaling")
        fig.tight_layout()
        fig.savefig(args.json.with_suffix(".png"), dpi=120)
        print(f"wrote {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
