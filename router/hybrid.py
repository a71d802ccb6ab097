"""The hybrid's decisions: whether a step runs the model drafter at all, and which draft wins. Suffix drafts where the
text repeats, a model drafter's where it does not, as one proposer made of two (`HybridProposer`); the vLLM plugin
shares the choice between two drafts (`choose_draft`).

Each step the suffix cache drafts first (microseconds). The drafter is run only where that is expected to pay, by
goodput, before it runs: (a) verifying the suffix draft alone yields `router.rate(suffix)` tokens per plain step's time;
(b) running the drafter costs its catch-up and drafting (`DraftCost`, in ms, over the router's `step_ms`) and then
yields what verifying the better of the two drafts yields, where the drafter's draft is expected to do what its recent
drafts for the same sequence did (`DrafterEstimate`, the router's calibrated rates of them; a sequence's first step runs
it, and a sequence that has not run it for a while runs it once more, since its text may have changed). The larger
expected tokens per unit of time wins. Neither a first run nor a probe happens where even a draft the target accepted
whole could not pay (`perfect_rate`): under load a draft token costs nearly a row's share of the pass, and the drafter
its cost over that share, so at high concurrency the drafter stays idle and the hybrid costs what the suffix cache
costs. When the drafter samples, its draft is taken as drawn: picking by the sampled
tokens' probabilities would bias the rejection rule (the tokens it verifies would no longer follow the drafter's
distribution).
Knows Proposals and costs, not models: the drafter's inputs (the target's features) pass through untouched.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from hybridspec.proposal import FeatureProposer, Proposal, Proposer, check_proposer, speculate_each
from hybridspec.router.base import Router, StepLoad
from hybridspec.router.cost import DraftCost


def choose_draft(suffix: Proposal, drafted: Proposal | None, expected: Callable[[Proposal], float],
                 sampling: bool = False) -> Proposal:
    """Of the suffix draft and the drafter's (None: the drafter did not run), the one expected to yield more; a
    sampled drafter draft is taken as drawn (see the module docstring)."""
    if drafted is None or not len(drafted):
        return suffix
    if sampling or not len(suffix) or expected(drafted) > expected(suffix):
        return drafted
    return suffix


def positional_chain(token_ids: Sequence[int], source: str) -> Proposal:
    """A chain from a proposer that rates none of its tokens (vLLM's EAGLE drafts), rated by position alone: node j
    gets 0.95 - 0.1 j (at least 0.05), so each of the first ten positions has a calibration bin of its own and the
    gate learns the acceptance at each position (a draft's later tokens are accepted less often) and can keep the
    prefix that pays."""
    return Proposal.chain(token_ids, probs=[max(0.95 - 0.1 * j, 0.05) for j in range(len(token_ids))], source=source)


class DrafterEstimate:
    """What the drafter's next draft is expected to yield, before it runs: the mean rate (expected tokens per plain
    step's time of its verification, the router's calibrated figure) of its recent drafts, decaying by `decay` per
    draft. None until it has drafted once."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay, self.weight, self.total = decay, 0.0, 0.0

    def observe(self, rate: float) -> None:
        self.weight = self.weight * self.decay + 1.0
        self.total = self.total * self.decay + rate

    @property
    def rate(self) -> float | None:
        return self.total / self.weight if self.weight else None


def drafter_pays(suffix_rate: float, drafter_rate: float | None, draft_steps: float) -> bool:
    """Running the drafter is expected to yield more tokens per unit of time than the suffix draft alone.

    suffix_rate: tokens per plain step's time of verifying the suffix draft (1.0: none); drafter_rate: the same of
    the drafter's draft (None: unknown, so it runs once); draft_steps: the drafter's own cost in plain steps. With the
    drafter, a step yields the better draft's tokens, r * v for a verification of v steps at rate r, and takes
    draft_steps longer; taking v = 1 (a draft's pass costs about one step, as the rates count it):
    max(r_d, r_s) / (1 + draft_steps) against r_s."""
    if drafter_rate is None:
        return True
    return max(drafter_rate, suffix_rate) / (1.0 + draft_steps) > suffix_rate


def drafter_step_pays(gate: Any, with_drafter: Sequence[Proposal | None], suffix_only: Sequence[Proposal | None],
                      contexts: Sequence[int], drafter_share: float | None) -> bool:
    """A step's drafter pass (the vLLM plugin's: one pass over every row) is expected to yield more tokens per unit
    of time than the step's suffix drafts alone. The two plans, row by row (None: no draft for that row), are priced
    by the gate: a step yields its rows' 1 + expected accepted tokens, in a pass of `gate.pass_cost` over their
    verified tokens; running the drafter adds `drafter_share` of that pass (its measured ms over the rest of the
    step's; None: not measured yet, so it runs). The drafter pays where E_d / (C_d (1 + share)) > E_s / C_s."""
    if drafter_share is None:
        return True
    rows = [i for i, (d, s) in enumerate(zip(with_drafter, suffix_only)) if d is not None or s is not None]
    if not rows:
        return False

    def value(plan: Sequence[Proposal | None]) -> tuple[float, float]:
        drafts = [plan[i] for i in rows]
        tokens = sum(1.0 + (gate.expected_tokens(d) if d is not None else 0.0) for d in drafts)
        ms = gate.pass_cost([1 + (len(d) if d is not None else 0) for d in drafts], [contexts[i] for i in rows])
        return tokens, ms

    tokens_d, ms_d = value(with_drafter)
    tokens_s, ms_s = value(suffix_only)
    return tokens_d * ms_s > tokens_s * ms_d * (1.0 + drafter_share)


def perfect_rate(router: Router, depth: int, context: int, load: StepLoad | None = None) -> float:
    """What the best draft `depth` deep could yield, in the router's tokens per plain step's time: a chain the target
    accepts whole (a tree of that depth commits no more, and costs more to verify)."""
    return router.rate(Proposal.chain([0] * depth, source="perfect"), context, load) if depth > 0 else 1.0


PROBE_AFTER = 16  # steps without the drafter after which a sequence runs it once more (then twice as many, and so on)


@dataclass
class _Sequence:
    estimate: DrafterEstimate = field(default_factory=DrafterEstimate)  # this sequence's drafts
    idle: int = 0                   # steps since the drafter last ran for it
    probe_after: int = PROBE_AFTER  # idle steps before the next probe


class HybridProposer:
    """A `FeatureProposer` over a model-free proposer (`suffix`) and a model drafter (`drafter`, a `DrafterProposer`).

    router: the engine's `Router` (its `expected_tokens`, `rate` and `step_ms`); draft_cost: the drafter's `DraftCost`,
    or the drafter kind whose built-in table to use. `chosen` counts the steps each source won, `drafter_runs` the
    steps that ran the drafter. The drafter's expected rate is kept per sequence (`estimate(request_id)`): a chat
    turn and an agent call served together need not agree on whether it pays.
    """

    wants_target_features = True
    prefers_trees = True  # the engine's default, as for the drafter alone
    late_prompt_features = True  # the suffix draft needs none: the first step drafts from it alone

    def __init__(self, suffix: Proposer, drafter: FeatureProposer, router: Router, num_speculative_tokens: int = 16,
                 draft_cost: DraftCost | str = "peagle") -> None:
        self.suffix, self.drafter = check_proposer(suffix), check_proposer(drafter)
        self.router = router
        self.drafts_trees = suffix.drafts_trees and drafter.drafts_trees
        # the drafter drafts at most its own K; the suffix cache up to the budget
        self.num_speculative_tokens = max(drafter.num_speculative_tokens, num_speculative_tokens)
        self.draft_cost = DraftCost.default(draft_cost) if isinstance(draft_cost, str) else draft_cost
        self.sequences: dict[Hashable, _Sequence] = {}
        self.chosen: Counter[str] = Counter()  # steps won, by proposal source ("" = nothing to draft)
        self.drafter_runs = 0
        self.sampling = False  # set_sampling: the drafter samples its drafts

    def set_sampling(self, probs_fn: Any, generator: Any) -> None:
        self.drafter.set_sampling(probs_fn, generator)
        self.sampling = probs_fn is not None

    def start_request(self, request_id: Hashable, prompt: Sequence[int], *, features: Any,
                      extends: Hashable | None = None) -> None:
        self.suffix.start_request(request_id, prompt, extends=extends)
        try:
            self.drafter.start_request(request_id, prompt, features=features, extends=extends)
        except BaseException:
            self.suffix.abort_request(request_id)
            raise
        self.sequences[request_id] = _Sequence()

    def prompt_features(self, request_id: Hashable, features: Any) -> None:
        self.drafter.prompt_features(request_id, features)

    def estimate(self, request_id: Hashable) -> DrafterEstimate:
        """What the drafter is expected to yield for this sequence."""
        return self.sequences[request_id].estimate

    def append(self, request_id: Hashable, tokens: Sequence[int], *, features: Any) -> None:
        self.suffix.append(request_id, tokens)
        self.drafter.append(request_id, tokens, features=features)  # kept: the drafter catches up when it drafts

    def speculate(self, request_id: Hashable, num_speculative_tokens: int | None = None, *,
                  tree: bool = False) -> Proposal:
        """tree=True: both draft trees of at most num_speculative_tokens nodes (the drafter's no deeper than its K)."""
        return self.speculate_many([request_id], [num_speculative_tokens], tree=tree)[0]

    def speculate_many(self, request_ids: Sequence[Hashable], num_speculative_tokens: Sequence[int | None], *,
                       tree: bool = False, load: StepLoad | None = None) -> list[Proposal]:
        """`speculate` for several sequences: each decides alone whether its drafter runs, and those that run it
        run it together (the drafter's one pass for all of them). load: the engine's last step's (`StepLoad`; None:
        a row alone), by which the router prices a draft token and the drafter's time."""
        budgets = [self.num_speculative_tokens if k is None else k for k in num_speculative_tokens]
        suffix = [self.suffix.speculate(rid, k, tree=tree) for rid, k in zip(request_ids, budgets)]
        contexts, runs = [], []
        for i, (rid, k, draft) in enumerate(zip(request_ids, budgets, suffix)):
            context = self.drafter.context_length(rid)
            draft_steps = self.draft_cost(self.drafter.pending(rid)) / self.router.step_ms(context, load)
            seq = self.sequences[rid]
            suffix_rate = self.router.rate(draft, context, load)
            pays = drafter_pays(suffix_rate, seq.estimate.rate, draft_steps)
            probe = seq.idle >= seq.probe_after
            contexts.append(context)
            if k > 0 and (pays or probe) and drafter_pays(  # and even a perfect draft could pay
                    suffix_rate, perfect_rate(self.router, min(k, self.drafter.num_speculative_tokens), context, load),
                    draft_steps):
                runs.append(i)
                seq.idle, seq.probe_after = 0, PROBE_AFTER if pays else 2 * seq.probe_after
            else:
                seq.idle += 1
        drafted: list[Proposal | None] = [None] * len(request_ids)
        if runs:
            made = speculate_each(self.drafter, [request_ids[i] for i in runs],
                                  [budgets[i] if tree else min(budgets[i], self.drafter.num_speculative_tokens)
                                   for i in runs], tree=tree)
            for i, proposal in zip(runs, made):
                drafted[i] = proposal
                self.drafter_runs += proposal.drafter_ran
                if len(proposal):
                    self.sequences[request_ids[i]].estimate.observe(self.router.rate(proposal, contexts[i], load))
        chosen = []
        for draft, other in zip(suffix, drafted):
            best = choose_draft(draft, other, self.router.expected_tokens, sampling=self.sampling)
            best.drafter_ran = other is not None and other.drafter_ran
            self.chosen[best.source if len(best) else ""] += 1
            chosen.append(best)
        return chosen

    def finish_request(self, request_id: Hashable) -> None:
        self.suffix.finish_request(request_id)
        self.drafter.finish_request(request_id)
        self.sequences.pop(request_id, None)

    def abort_request(self, request_id: Hashable) -> None:
        self.suffix.abort_request(request_id)
        self.drafter.abort_request(request_id)
        self.sequences.pop(request_id, None)
