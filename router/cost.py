"""The verify-cost model: what one target forward pass over [last token] + k draft tokens costs.

Speculation pays only where the expected accepted tokens outweigh the extra cost of the pass, so the router, the
engine and trace replay all read one table: t(k) in ms for k draft tokens (k = 0 is a plain decoding step),
piecewise-linear between its points and extrapolated from the last two. The default is SmolLM2-135M-Instruct's, fp32,
1 thread, 512 tokens of context, measured on this project's 2-core CPU with
`python benchmarks/bench_verify_cost.py --json PATH`; that command measures the user's own machine, and any
{k: ms} table (a GPU server's, say) can be given instead.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import numpy as np

# The built-in tables: t(k) in ms of greedy steps of SmolLM2-135M fp32, 1 thread, on this project's CPU, at three
# contexts (`python benchmarks/bench_verify_cost.py --threads 1 --context 512,2048,4096 --repeats 9`; BENCHMARKS.md,
# "Verification cost on this CPU"). The 512 row is the default table; the router interpolates between contexts.
DEFAULT_VERIFY_MS: dict[int, float] = {
    0: 53.8, 1: 56.5, 2: 60.7, 3: 63.6, 4: 67.4, 5: 69.7, 6: 73.1, 8: 76.9, 12: 86.8, 16: 94.0, 32: 130.4}
DEFAULT_VERIFY_MS_BY_CONTEXT: dict[int, dict[int, float]] = {
    512: DEFAULT_VERIFY_MS,
    2048: {0: 63.4, 1: 67.2, 2: 73.3, 3: 77.5, 4: 81.5, 5: 84.4, 6: 88.4, 8: 93.3, 12: 109.6, 16: 121.5, 32: 175.9},
    4096: {0: 75.6, 1: 82.2, 2: 89.7, 3: 95.0, 4: 98.3, 5: 103.0, 6: 109.6, 8: 116.4, 12: 146.0, 16: 162.5, 32: 251.9},
}


def read_cost_json(source):
    """`source` itself, or the table read from a JSON file at that path (unwrapping a top-level "verify_cost")."""
    data = source
    if isinstance(source, (str, os.PathLike)):
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{source}: cannot read the verify-cost table ({e})") from None
    if isinstance(data, Mapping) and isinstance(data.get("verify_cost"), Mapping):
        data = data["verify_cost"]
    return data


class VerifyCost:
    """t(k): the cost in ms of verifying k draft tokens in one pass."""

    def __init__(self, table_ms: Mapping[int, float] | None = None):
        items = sorted((int(k), float(v)) for k, v in (DEFAULT_VERIFY_MS if table_ms is None else table_ms).items())
        if not items or items[0][0] != 0:
            raise ValueError("a verify-cost table needs k = 0 (a plain decoding step)")
        if any(k < 0 or v <= 0 for k, v in items):
            raise ValueError("verify-cost table: k must be >= 0 and every cost > 0 ms")
        self.ks = np.array([k for k, _ in items], dtype=np.float64)
        self.ms = np.array([v for _, v in items], dtype=np.float64)

    def __call__(self, k: np.ndarray | int) -> np.ndarray:
        k = np.asarray(k, dtype=np.float64)
        out = np.interp(k, self.ks, self.ms)
        if len(self.ks) > 1:
            slope = (self.ms[-1] - self.ms[-2]) / (self.ks[-1] - self.ks[-2])
            out = np.where(k > self.ks[-1], self.ms[-1] + slope * (k - self.ks[-1]), out)
        return out

    def relative(self, k: int) -> float:
        """t(k) / t(0): the cost of the pass in plain decoding steps."""
        return float(self(k)) / float(self.ms[0])

    def table(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in zip(self.ks, self.ms)}

    @classmethod
    def load(cls, source: "VerifyCost | Mapping | str | os.PathLike | None") -> "VerifyCost":
        """A cost model from itself, a {k: ms} mapping, None (the default), or a JSON file: {"k": ms, ...} or the
        output of `python benchmarks/bench_verify_cost.py` ({"draft_tokens": [...], "ms": [...]})."""
        if source is None or isinstance(source, VerifyCost):
            return source or cls()
        data = read_cost_json(source)
        try:
            if isinstance(data, Mapping) and "draft_tokens" in data:
                data = dict(zip(map(int, data["draft_tokens"]), map(float, data["ms"]), strict=True))
            return cls({int(k): float(v) for k, v in data.items()})
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{source!r}: expected a table {{k: ms}} with k = 0 included ({e})") from None
