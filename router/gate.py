"""The default router's decision: how much of a draft is worth a verification pass, from the verify-cost model and
calibrated acceptance (which also gives a draft's expected accepted tokens). Knows Proposals and costs, not models."""
from __future__ import annotations

import heapq
from typing import Any, Mapping, Sequence

import numpy as np

from hybridspec.proposal import Proposal
from hybridspec.router.base import Route, StepLoad
from hybridspec.router.cost import (DEFAULT_VERIFY_MS_BY_CONTEXT, PassCost, VerifyCost, piecewise_linear,
                                    read_cost_json)

def verify_costs_by_context(source: Any = None) -> dict[int, VerifyCost]:
    """{context length: VerifyCost} from: None (the built-in tables); a `VerifyCost`, a {k: ms} table or the JSON of
    one measurement (any context); a {context: {k: ms}} mapping; or the JSON written by
    `python benchmarks/bench_verify_cost.py --context A,B,... --json PATH` (or its path), whose "by_context" holds one
    table per context."""
    if source is None:
        source = DEFAULT_VERIFY_MS_BY_CONTEXT
    data = read_cost_json(source)
    if isinstance(data, Mapping) and "by_context" in data:
        return {int(m["context"]): VerifyCost.load(m) for m in data["by_context"]}
    if isinstance(data, Mapping) and data and all(isinstance(v, Mapping) for v in data.values()) \
            and "draft_tokens" not in data:
        return {int(c): VerifyCost.load(t) for c, t in sorted(data.items())}
    return {0: VerifyCost.load(data)}


def _interpolate(points: Sequence[float], values: Sequence[float], x: float) -> float:
    return float(piecewise_linear(np.asarray(points, dtype=np.float64), np.asarray(values, dtype=np.float64), x))


CALIBRATION_BINS = 10  # equal-width bins of a proposer's probability, each with its own acceptance count


class CostGate:
    """The default router: trims every proposal to the draft size with the best expected tokens per unit of cost.

    A proposal's probs are path probabilities (the chance that a node and all its ancestors are accepted), so keeping
    the m most probable nodes gives an expected 1 + sum(their probs) tokens for a pass costing cost(m, context) plain
    steps. The gate keeps the m that maximises that ratio, and no draft at all unless the ratio beats a plain step by
    `min_gain` (a margin for the noise in measured costs and the per-step work outside the forward pass): a pass with
    drafts costs more than a plain step (growing with the draft and the context), so a draft that is probably
    rejected would slow decoding down; speculation must not cost when it has nothing to offer.

    Proposers' probabilities are estimates (the suffix tree's count ratios were measured overconfident on SmolLM2
    agent sessions), so the gate calibrates them online:
    `observe` counts, per proposal source and probability decile, how many verified nodes were accepted, and `trim`
    uses that rate, starting from the proposer's own value (a prior worth `prior_weight` observations) and following
    drifts (older counts decay by `decay` per observation).

    A step of several rows (or with prompt chunks beside) is planned as a whole (`plan`): its draft tokens go to the
    rows where they are expected to add the most tokens per ms of the pass (`PassCost`: the products of all its
    tokens, each row's work and attention), as long as they raise the rows' tokens per ms of a decode pass of those
    rows (with prompt chunks beside, a draft token must pay as it would without them); under load a draft token costs
    nearly a row's share of the pass, so few or none pay. The plan's `StepLoad` prices a row of such a step: `rate`
    and `step_ms` given it answer for one (a hybrid weighs its drafter against that).
    """

    MAX_DRAFT = 256  # draft sizes the cost tables are tabulated for

    def __init__(self, verify_cost: Any = None, min_gain: float = 1.05, calibrate: bool = True,
                 prior_weight: float = 4.0, decay: float = 0.995):
        self.min_gain = min_gain
        self.calibrate, self.prior_weight, self.decay = calibrate, prior_weight, decay
        self._counts: dict[str, list[list[float]]] = {}  # source -> per decile [nodes seen, nodes accepted]
        costs = verify_costs_by_context(verify_cost)
        data = read_cost_json(verify_cost) if verify_cost is not None else None
        measured = data.get("pass") if isinstance(data, Mapping) else None
        self.set_costs(costs, PassCost.load(measured, costs))

    def set_costs(self, by_context: Mapping[int, VerifyCost], pass_cost: PassCost) -> None:
        """Plan by these tables from now on (one row's t(k) by context, and a batched pass's cost): the vLLM plugin
        refits them to the passes it times (`router.measured`)."""
        self.costs = dict(sorted(by_context.items()))
        self._contexts = list(self.costs)
        # Relative cost by draft size, made non-decreasing: a measured dip (a kernel that happens to suit 3 rows
        # better than 2) is noise to plan with, not a reason to draft more.
        ks = np.arange(self.MAX_DRAFT)
        self._relative = [np.maximum.accumulate(np.maximum(1.0, c(ks) / float(c.ms[0]))) for c in self.costs.values()]
        self.pass_cost = pass_cost

    def cost(self, k: int, context: int = 0) -> float:
        """t(k) / t(0), the pass in plain steps, at `context` tokens: interpolated between measured contexts."""
        if k == 0:
            return 1.0
        if k >= self.MAX_DRAFT:
            return max(1.0, _interpolate(self._contexts, [c.relative(k) for c in self.costs.values()], context))
        return _interpolate(self._contexts, [float(r[k]) for r in self._relative], context)

    def accept_probability(self, source: str, p: float) -> float:
        """Calibrated chance that a node the proposer rated `p` (a path probability) is accepted."""
        counts = self._counts.get(source) if self.calibrate else None
        if counts is None:
            return p
        seen, accepted = counts[_bin(p)]
        return (accepted + self.prior_weight * p) / (seen + self.prior_weight)

    def calibrated_path_probs(self, proposal: Proposal) -> list[float]:
        """Each node's calibrated chance of acceptance, never above its parent's."""
        path: list[float] = []
        for parent, p in zip(proposal.parents, _path_probs(proposal)):
            path.append(min(self.accept_probability(proposal.source, p), path[parent] if parent >= 0 else 1.0))
        return path

    def expected_tokens(self, proposal: Proposal) -> float:
        """Calibrated expected number of accepted draft tokens."""
        return float(sum(self.calibrated_path_probs(proposal)))

    def trim(self, proposal: Proposal, context: int = 0) -> Proposal:
        """The part of one row's draft worth verifying, the row alone in its pass."""
        keep, _ = self._best(proposal, context)
        return proposal.subset(sorted(keep))

    def rate(self, proposal: Proposal, context: int = 0, load: StepLoad | None = None) -> float:
        """Expected tokens per plain step's time of verifying the proposal as `trim` keeps it (1.0: nothing kept, a
        plain step); in a step of `load`, per the row's share of the pass (`step_ms`)."""
        if load is not None:
            return self._loaded_rate(proposal, context, load)
        keep, value = self._best(proposal, context)
        return value if keep else 1.0

    def step_ms(self, context: int = 0, load: StepLoad | None = None) -> float:
        """A plain decoding step at `context` tokens, in ms (the unit of `cost`); in a step of `load`, a row's share
        of the pass."""
        if load is not None:
            return load.row_ms
        return _interpolate(self._contexts, [float(c.ms[0]) for c in self.costs.values()], context)

    def plan(self, proposals: Sequence[Proposal], contexts: Sequence[int], other_tokens: int = 0) -> Route:
        """Every row's draft of one step, planned together (see the class docstring); other_tokens: the prompt
        tokens the pass runs beside. One row alone is trimmed as `trim` does (and has no load).

        Beside prompt chunks the rows' tokens are priced as in a decode pass of the same rows, each draft token at
        its marginal cost in the larger pass: it costs the machine as much there (more: the products' marginal token
        at a large pass) and delays the prompts' first tokens and every row. Counting the chunks' seconds as the
        rows' would make any draft look free beside them (measured: 16 agents' median first token 10.4 s against
        6.0 s without speculation)."""
        rows = len(proposals)
        if rows <= 1 and not other_tokens:
            return Route([sorted(self._best(p, c)[0]) for p, c in zip(proposals, contexts)])
        cost = self.pass_cost
        n = rows + other_tokens
        ms = cost([1] * rows, contexts)  # a decode pass of these rows: what their tokens are priced against
        load = StepLoad(ms / rows, n)
        expected, base = float(rows), rows / ms
        slope = (cost.tokens(n + 16) - cost.tokens(n)) / 16
        # candidates: each row's nodes, most probable first (a prefix is a subtree), by tokens per marginal ms
        paths = [self.calibrated_path_probs(p) for p in proposals]
        orders = [sorted(range(len(p)), key=lambda i: (-path[i], i)) for p, path in zip(proposals, paths)]
        per_token = [max(slope + cost.attention_ms(c), 1e-6) for c in contexts]  # a draft token's marginal ms
        heap = [(-paths[r][order[0]] / per_token[r], r, 0) for r, order in enumerate(orders) if order]
        heapq.heapify(heap)
        taken, best, best_value = [], 0, base * self.min_gain
        while heap:
            _, r, j = heapq.heappop(heap)
            g = paths[r][orders[r][j]]
            ms += cost.tokens(n + 1) - cost.tokens(n) + cost.attention_ms(contexts[r])
            n, expected = n + 1, expected + g
            taken.append(r)
            if expected / ms > best_value:
                best, best_value = len(taken), expected / ms
            if j + 1 < len(orders[r]):
                heapq.heappush(heap, (-paths[r][orders[r][j + 1]] / per_token[r], r, j + 1))
        counts = [0] * rows
        for r in taken[:best]:
            counts[r] += 1
        return Route([sorted(order[:k]) for order, k in zip(orders, counts)], load)

    def _loaded_rate(self, proposal: Proposal, context: int, load: StepLoad) -> float:
        """`rate` for a row of a step of `load`: its share of the pass is the plain step, and each draft token costs
        the products' marginal token and its attention."""
        share, n = load.row_ms, load.pass_tokens
        per_token = self.pass_cost.tokens(n + 1) - self.pass_cost.tokens(n) + self.pass_cost.attention_ms(context)
        path = sorted(self.calibrated_path_probs(proposal), reverse=True)
        best, expected = 1.0, 1.0
        for m, g in enumerate(path, start=1):
            expected += g
            best = max(best, expected / (1 + m * per_token / share))
        return best

    def _best(self, proposal: Proposal, context: int) -> tuple[list[int], float]:
        """The nodes worth verifying (most probable first) and their expected tokens per plain step's time."""
        n = len(proposal)
        if n == 0:
            return [], 1.0
        # calibrated and never above the parent's: every prefix of `order` below is then a subtree
        path = self.calibrated_path_probs(proposal)
        order = sorted(range(n), key=lambda i: (-path[i], i))
        best_m, best_value, expected = 0, self.min_gain, 1.0
        for m, i in enumerate(order, start=1):
            expected += path[i]
            value = expected / self.cost(m, context)
            if value > best_value:
                best_m, best_value = m, value
        return order[:best_m], best_value

    def observe(self, proposals: Sequence[Proposal], accepted: Sequence[Sequence[int]]) -> None:
        """Learn from verification: accepted[b] are the indices of proposals[b]'s nodes that were accepted."""
        for proposal, taken in zip(proposals, accepted):
            if not len(proposal) or proposal.probs is None:
                continue
            counts = self._counts.setdefault(proposal.source, [[0.0, 0.0] for _ in range(CALIBRATION_BINS)])
            taken = set(taken)
            for i, p in enumerate(_path_probs(proposal)):
                bucket = counts[_bin(p)]
                bucket[0] = bucket[0] * self.decay + 1.0
                bucket[1] = bucket[1] * self.decay + (i in taken)


def _bin(p: float) -> int:
    """The calibration bin of a probability in [0, 1]."""
    return min(int(p * CALIBRATION_BINS), CALIBRATION_BINS - 1)


def _path_probs(proposal: Proposal) -> list[float]:
    """Each node's probability, capped by its parent's (1.0 for proposers that give none)."""
    if proposal.probs is None:
        return [1.0] * len(proposal)
    path: list[float] = []
    for parent, p in zip(proposal.parents, proposal.probs):
        path.append(min(float(p), path[parent] if parent >= 0 else 1.0))
    return path
