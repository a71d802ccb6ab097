"""A pass's cost learnt from the passes a server runs, for a gate with no table measured on its model and hardware
(the vLLM plugin's: vLLM's kernels on a GPU or a CPU cost what our engine's tables do not say).

    ms = fixed + per_token * tokens + per_row * (rows - 1) + attention * sum over rows of tokens_r * context_r / 1000

fitted by recursive least squares in relative units (each coefficient a multiple of the prior's, each pass's error
relative to its prediction), starting from the gate's own tables: a pass whose time is off the prediction moves every
coefficient in proportion to its share of the pass, so a uniformly slower machine rescales them all, and only passes
that differ in draft tokens tell the cost of one apart. The first passes set the overall scale (their median ratio to
the prior), so a GPU 30x faster than the prior's CPU is learnt in a few steps; after them a pass more than 3x off its
prediction (a step that waited for requests) is left out. Knows counts and milliseconds, not models.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hybridspec.router.cost import PassCost, VerifyCost

SCALE_PASSES = 5  # passes whose median ratio to the prior sets the overall scale before fitting
OUTLIER = 3.0  # a pass this many times off its prediction (either way) is not learnt from


class PassCostFit:
    """Learns `ms` of a pass from `observe(row_tokens, contexts, ms)`; `pass_cost()` and `verify_costs()` give the gate
    its tables from the fit. prior: the gate's PassCost; prior_weight: how many passes' worth the prior counts."""

    def __init__(self, prior: PassCost, prior_weight: float = 1.0, noise: float = 0.1) -> None:
        per_token = (prior.tokens(17) - prior.tokens(1)) / 16
        self.prior = np.array([max(prior.tokens(1) - per_token, 1e-3), max(per_token, 1e-3),
                               max(prior.per_row_ms, 1e-3), max(prior.attention_ms(4096) / 4096 * 1000, 1e-6)])
        self.weights = np.ones(4)  # coefficients as multiples of the prior's
        self.covariance = np.eye(4) / prior_weight
        self.noise = noise
        self.passes = 0  # learnt from
        self._ratios: list[float] = []

    @staticmethod
    def features(row_tokens: Sequence[int], contexts: Sequence[int]) -> np.ndarray:
        attention = sum(q * c for q, c in zip(row_tokens, contexts)) / 1000
        return np.array([1.0, float(sum(row_tokens)), float(max(len(row_tokens) - 1, 0)), attention])

    def predict(self, row_tokens: Sequence[int], contexts: Sequence[int]) -> float:
        return float(self.features(row_tokens, contexts) @ self.costs())

    def coefficients(self) -> np.ndarray:
        return np.maximum(self.weights, 0.01)  # a cost never falls with more work

    def observe(self, row_tokens: Sequence[int], contexts: Sequence[int], ms: float) -> bool:
        """Learn from one pass; False where it was left out (no rows, a time <= 0, or an outlier)."""
        if not row_tokens or ms <= 0:
            return False
        predicted = self.predict(row_tokens, contexts)
        if len(self._ratios) < SCALE_PASSES:
            self._ratios.append(ms / predicted)
            if len(self._ratios) == SCALE_PASSES:
                self.weights *= float(np.median(self._ratios))
            return False
        if not 1 / OUTLIER < ms / predicted < OUTLIER:
            return False
        u = self.features(row_tokens, contexts) * self.prior / predicted
        shared = self.covariance @ u
        gain = shared / (self.noise ** 2 + u @ shared)
        self.weights = self.weights + gain * (ms / predicted - u @ self.weights)
        self.covariance = self.covariance - np.outer(gain, shared)
        self.passes += 1
        return True

    def costs(self) -> np.ndarray:
        """ms: fixed, per token, per further row, per token per 1,000 tokens of context."""
        return self.prior * self.coefficients()

    def pass_cost(self) -> PassCost:
        fixed, per_token, per_row, attention = self.costs()
        return PassCost({1: fixed + per_token, 1 << 16: fixed + per_token * (1 << 16)}, per_row,
                        {0: 0.0, 1 << 20: attention * (1 << 20) / 1000})

    def verify_costs(self, contexts: Sequence[int] = (0, 2048, 8192, 32768)) -> dict[int, VerifyCost]:
        """One row's t(k) at each context, as the gate's tables by context."""
        fixed, per_token, _, attention = self.costs()
        tables = {}
        for c in contexts:
            tables[int(c)] = VerifyCost({k: fixed + (per_token + attention * c / 1000) * (1 + k) for k in (0, 256)})
        return tables
