"""The replay report: per framework and overall, per proposer; as a table, as JSON and as a figure."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridspec.agent_traces.replay import ReplayStats
from hybridspec.router import VerifyCost

_COLUMNS = [  # (header, metric key, format)
    ("calls", "calls", "{:,}"),
    ("resp tokens", "response_tokens", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("tok/step", "tokens_per_step", "{:.2f}"),
    ("accept", "acceptance_rate", "{:.3f}"),
    ("p50 µs", "us_per_speculate_p50", "{:.1f}"),
    ("p99 µs", "us_per_speculate_p99", "{:.1f}"),
    ("upd µs/tok", "us_per_append_token", "{:.2f}"),
    ("speedup", "projected_speedup", "{:.2f}x"),
]


@dataclass
class ReplayReport:
    """Replay results: `results[proposer label][framework]`, the cost model, and the sources passed over."""

    results: dict[str, dict[str, ReplayStats]]
    cost: VerifyCost
    num_speculative_tokens: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def proposers(self) -> list[str]:
        return list(self.results)

    @property
    def frameworks(self) -> list[str]:
        seen: dict[str, None] = {}
        for per_fw in self.results.values():
            seen.update(dict.fromkeys(per_fw))
        return list(seen)

    def overall(self, proposer: str) -> ReplayStats:
        return ReplayStats.merge(list(self.results[proposer].values()))

    def to_json(self) -> dict[str, Any]:
        return {
            "frameworks": {fw: {p: self.results[p][fw].summary(self.cost) for p in self.proposers
                                if fw in self.results[p]} for fw in self.frameworks},
            "overall": {p: self.overall(p).summary(self.cost) for p in self.proposers},
        }

    def format_table(self) -> str:
        data = self.to_json()
        sections = [(fw, data["frameworks"][fw]) for fw in self.frameworks] + [("overall", data["overall"])]
        width = max(8, *(len(p) for p in self.proposers))
        header = f"{'proposer':<{width}}" + "".join(f"{h:>13}" for h, _, _ in _COLUMNS)
        lines = []
        for title, rows in sections:
            lines += ["", f"{title} (num_speculative_tokens {self.num_speculative_tokens})", header]
            for p, m in rows.items():
                lines.append(f"{p:<{width}}" + "".join(f"{fmt.format(m[key]):>13}" for _, key, fmt in _COLUMNS))
        if self.skipped:
            lines += ["", f"skipped {len(self.skipped)} bad file(s):"] + [f"  {p}: {why}" for p, why in self.skipped]
        return "\n".join(lines[1:])

    def plot(self, path: str | os.PathLike, cost_label: str = "") -> None:
        """Side-by-side comparison of the proposers: distribution of tokens per step in each framework (top) and
        projected speedup per framework (bottom)."""
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        frameworks, proposers = self.frameworks, self.proposers
        colors = plt.get_cmap("tab10").colors
        edges = _bin_edges(self.num_speculative_tokens + 1)
        labels = [str(lo) if hi == lo else f"{lo}-{hi}" for lo, hi in edges]
        labels[-1] += "\n(all K\naccepted)"  # the last bin is a fully accepted draft + the target's token

        fig = plt.figure(figsize=(max(10.0, 4.2 * len(frameworks)), 8.5), constrained_layout=True)
        grid = fig.add_gridspec(2, len(frameworks))
        width = 0.8 / len(proposers)
        x = np.arange(len(edges))
        top_axes = []
        for col, fw in enumerate(frameworks):
            ax = fig.add_subplot(grid[0, col], sharey=top_axes[0] if top_axes else None)
            top_axes.append(ax)
            for i, p in enumerate(proposers):
                stats = self.results[p].get(fw)
                if stats is None or stats.steps == 0:
                    continue
                share = [100.0 * np.count_nonzero((stats.produced >= lo) & (stats.produced <= hi)) / stats.steps
                         for lo, hi in edges]
                ax.bar(x + (i - (len(proposers) - 1) / 2) * width, share, width, color=colors[i % 10],
                       label=f"{p}: mean {stats.response_tokens / stats.steps:.2f}")
            ax.set_title(f"{fw}: tokens per step")
            ax.set_xticks(x, labels)
            ax.set_xlabel("tokens produced in one step (accepted + 1)")
            ax.set_yscale("log")  # most steps emit one token; the rarer long ones carry the speedup
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
            ax.set_ylabel("share of steps (log scale)")
            ax.legend(title="proposer", fontsize="small")
            ax.grid(axis="y", alpha=0.3)

        ax = fig.add_subplot(grid[1, :])
        groups = frameworks + ["overall"]
        gx = np.arange(len(groups))
        top = 1.0
        for i, p in enumerate(proposers):
            values = [self.results[p][fw].projected_speedup(self.cost) if fw in self.results[p] else np.nan
                      for fw in frameworks] + [self.overall(p).projected_speedup(self.cost)]
            bars = ax.bar(gx + (i - (len(proposers) - 1) / 2) * width, values, width, color=colors[i % 10], label=p)
            ax.bar_label(bars, fmt="%.2fx", fontsize="small", padding=2)
            top = max(top, np.nanmax(values))
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="no speculation (1.0x)")
        ax.set_xticks(gx, groups)
        ax.set_ylim(0, top * 1.18)
        ax.set_ylabel("projected speedup (x, higher is better)")
        ax.set_title("Projected decoding speedup per framework" + (f" (verify cost of {cost_label})" if cost_label
                                                                   else ""))
        ax.legend(title="proposer", loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small")
        ax.grid(axis="y", alpha=0.3)
        fig.suptitle(f"Speculative decoding replayed on agent traces (greedy oracle, max {self.num_speculative_tokens} "
                     f"draft tokens per step)", fontsize="large")
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _bin_edges(max_tokens: int) -> list[tuple[int, int]]:
    """Inclusive (lo, hi) bins: 1, 2, 3, 4, power-of-two ranges, and max_tokens (a fully accepted draft) alone."""
    edges = [(n, n) for n in range(1, min(4, max_tokens) + 1)]
    lo = 5
    while lo < max_tokens:
        hi = min(2 * (lo - 1), max_tokens - 1)
        edges.append((lo, hi))
        lo = hi + 1
    if max_tokens > 4:
        edges.append((max_tokens, max_tokens))
    return edges
