"""The verify-cost model the router decides by: what one target forward pass over [last token] + k draft tokens costs.

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
from typing import Mapping, Sequence

import numpy as np

# The built-in tables: t(k) in ms of greedy steps of SmolLM2-135M fp32, 1 thread, on this project's CPU, at three
# contexts (`python benchmarks/bench_verify_cost.py --threads 1 --context 512,2048,4096 --repeats 9`; BENCHMARKS.md,
# "Verification cost on this CPU"). The 512 row is the default table; the router interpolates between contexts.
DEFAULT_VERIFY_MS: dict[int, float] = {
    0: 47.5, 1: 51.6, 2: 56.4, 3: 62.8, 4: 66.0, 5: 67.9, 6: 71.2, 8: 74.5, 12: 84.5, 16: 92.1, 32: 127.6}
DEFAULT_VERIFY_MS_BY_CONTEXT: dict[int, dict[int, float]] = {
    512: DEFAULT_VERIFY_MS,
    2048: {0: 54.9, 1: 60.8, 2: 67.6, 3: 74.2, 4: 77.7, 5: 81.1, 6: 84.6, 8: 90.3, 12: 106.5, 16: 116.8, 32: 170.3},
    4096: {0: 69.3, 1: 76.4, 2: 85.2, 3: 94.4, 4: 97.1, 5: 101.4, 6: 106.8, 8: 115.1, 12: 143.7, 16: 162.8, 32: 247.8},
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


def piecewise_linear(xs: np.ndarray, ys: np.ndarray, x: np.ndarray | float) -> np.ndarray:
    """Linear between the points (xs increasing), flat below the first, extrapolated from the last two above the
    last: how every cost table here is read between and past its measured points."""
    x = np.asarray(x, dtype=np.float64)
    out = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), out)
    return out


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
        return piecewise_linear(self.ks, self.ms, k)

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


# What a model drafter costs per draft on this project's CPU, by drafter kind: ms of one `speculate` of the drafter's
# K after `positions` steps' worth of target features it had not yet run (its lazy catch-up, in the same pass for
# P-EAGLE and FastEagle; before its K passes for EAGLE-3; nothing for the LSTM, which reads the last position only).
# SmolLM2-shaped drafters, 1 thread, bfloat16 products where the CPU has them, as the engine runs them:
# `python benchmarks/bench_drafters.py --catch-up 1,16,64,256,1024 --json PATH` ("catch_up_ms"; BENCHMARKS.md).
DEFAULT_DRAFT_MS: dict[str, dict[int, float]] = {
    "peagle": {1: 4.3, 16: 5.4, 64: 8.3, 256: 21.7, 1024: 119.5},
    "eagle3": {1: 5.3, 16: 5.4, 64: 6.8, 256: 14.2, 1024: 72.9},
    "fasteagle": {1: 7.7, 16: 10.2, 64: 17.8, 256: 54.5, 1024: 368.9},
    "lstm": {1: 8.2, 16: 8.1, 64: 8.2, 256: 8.2, 1024: 9.3},
}


class DraftCost:
    """d(n): the cost in ms of drafting after catching up n positions, piecewise-linear in n between measured points
    (extrapolated from the last two)."""

    def __init__(self, table_ms: Mapping[int, float]):
        items = sorted((int(n), float(v)) for n, v in table_ms.items())
        if not items or any(n < 0 or v <= 0 for n, v in items):
            raise ValueError("a draft-cost table needs positions >= 0 and every cost > 0 ms")
        self.ns = np.array([n for n, _ in items], dtype=np.float64)
        self.ms = np.array([v for _, v in items], dtype=np.float64)

    def __call__(self, positions: int) -> float:
        return float(piecewise_linear(self.ns, self.ms, positions))

    @classmethod
    def default(cls, kind: str) -> "DraftCost":
        """The built-in table of a drafter kind (P-EAGLE's for a kind without one)."""
        return cls(DEFAULT_DRAFT_MS.get(kind, DEFAULT_DRAFT_MS["peagle"]))


# A batched step's pass besides attention, SmolLM2-135M fp32, 1 thread, this project's CPU (`measure_pass_cost` in
# hybridspec.model.calibration, repeats=5): ms of a pass over n tokens in all, and what each further row adds.
DEFAULT_PASS_TOKENS_MS: dict[int, float] = {
    1: 63.1, 2: 69.9, 4: 100.9, 8: 109.4, 16: 142.2, 32: 226.6, 64: 368.7, 128: 643.9, 256: 1244.8}
DEFAULT_PER_ROW_MS = 2.2


class PassCost:
    """What one pass of the target costs in ms when it verifies several rows' drafts (and runs prompt chunks):

        T = tokens(N) + per_row * (rows - 1) + sum over rows of attention(context_r) * tokens_r

    tokens(n): the products of n tokens in all (piecewise-linear in n); per_row: the work each further row adds;
    attention(context): what one token at `context` costs more than at a short one (from the one-row verify-cost
    tables by context: the slope of t(k) at that context less the products' slope)."""

    def __init__(self, tokens_ms: Mapping[int, float], per_row_ms: float, attention_ms: Mapping[int, float]):
        items = sorted((int(n), float(v)) for n, v in tokens_ms.items())
        if not items or items[0][0] < 1 or any(v <= 0 for _, v in items) or per_row_ms < 0:
            raise ValueError("a pass-cost table needs n >= 1 tokens, every cost > 0 ms and per_row_ms >= 0")
        self.ns = np.array([n for n, _ in items], dtype=np.float64)
        self.ms = np.maximum.accumulate(np.array([v for _, v in items], dtype=np.float64))  # more tokens never cheaper
        self.per_row_ms = float(per_row_ms)
        contexts = sorted(attention_ms.items()) or [(0, 0.0)]
        self.contexts = np.array([c for c, _ in contexts], dtype=np.float64)
        self.attention = np.array([max(0.0, a) for _, a in contexts], dtype=np.float64)

    def tokens(self, n: float) -> float:
        return float(piecewise_linear(self.ns, self.ms, n))

    def attention_ms(self, context: float) -> float:
        return float(piecewise_linear(self.contexts, self.attention, context)) if len(self.contexts) > 1 \
            else float(self.attention[0])

    def __call__(self, row_tokens: Sequence[int], contexts: Sequence[int], other_tokens: int = 0) -> float:
        """The pass: row r verifies row_tokens[r] tokens at contexts[r]; other_tokens (prompt chunks) run beside."""
        return (self.tokens(sum(row_tokens) + other_tokens) + self.per_row_ms * max(0, len(row_tokens) - 1)
                + sum(self.attention_ms(c) * q for q, c in zip(row_tokens, contexts)))

    @classmethod
    def load(cls, measured: Mapping | None, by_context: Mapping[int, "VerifyCost"]) -> "PassCost":
        """From this machine's measurement ({"tokens", "tokens_ms", "per_row_ms"}, `measure_pass_cost`; None: the
        built-in table) and the verify-cost tables by context, whose slopes give attention."""
        tokens_ms = DEFAULT_PASS_TOKENS_MS if measured is None else \
            dict(zip(map(int, measured["tokens"]), map(float, measured["tokens_ms"]), strict=True))
        per_row = DEFAULT_PER_ROW_MS if measured is None else float(measured["per_row_ms"])
        products = piecewise_linear(np.array(sorted(map(int, tokens_ms)), dtype=np.float64),
                                    np.array([float(tokens_ms[k]) for k in sorted(tokens_ms, key=int)]), [1.0, 17.0])
        products_slope = float(products[1] - products[0]) / 16
        attention = {c: float(cost(16) - cost(0)) / 16 - products_slope for c, cost in by_context.items()}
        return cls({int(n): float(v) for n, v in tokens_ms.items()}, per_row, attention)
