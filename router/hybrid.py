"""The hybrid's decision, which draft wins: suffix drafts where the text repeats, a model drafter's where it does not,
as one proposer made of two (`HybridProposer`) and as the rule the vLLM plugin shares (`choose_draft`).

Each step the suffix cache drafts first (microseconds). If its draft is expected to be accepted for at least
`suffix_threshold` tokens, it is used and the model drafter is not run (the rule of Arctic's hybrid, whose threshold
is the drafter's K). Otherwise the drafter drafts too; greedy, the draft with the larger calibrated expectation wins.
When the drafter samples, its draft is taken as drawn: picking by the sampled tokens' probabilities would bias the
rejection rule (the tokens it verifies would no longer follow the drafter's distribution).
Knows Proposals, not models: the drafter's inputs (the target's features) pass through untouched.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Hashable, Sequence

from hybridspec.proposal import FeatureProposer, Proposal, Proposer, check_proposer


def suffix_suffices(suffix: Proposal, suffix_threshold: float, expected: Callable[[Proposal], float]) -> bool:
    """The suffix draft is used without asking the drafter: it is expected to yield at least `suffix_threshold`
    accepted tokens."""
    return len(suffix) > 0 and expected(suffix) >= suffix_threshold


def choose_draft(suffix: Proposal, drafted: Proposal | None, suffix_threshold: float,
                 expected: Callable[[Proposal], float], sampling: bool = False) -> Proposal:
    """The hybrid's choice for one sequence, shared by `HybridProposer` and the vLLM plugin's hybrid.

    drafted: the model drafter's draft, or None where it was not run (`suffix_suffices`). The suffix draft wins when
    it suffices; else the drafter's when it has tokens and, greedy, a larger expectation (a sampled draft is taken as
    drawn, see the module docstring).
    """
    if drafted is None or suffix_suffices(suffix, suffix_threshold, expected) or not len(drafted):
        return suffix
    if sampling or not len(suffix) or expected(drafted) > expected(suffix):
        return drafted
    return suffix


class HybridProposer:
    """A `FeatureProposer` over a model-free proposer (`suffix`) and a model drafter (`drafter`, a `DrafterProposer`).

    expected(proposal) -> expected accepted tokens; by default the proposal's own score. Pass a calibrated estimate
    (e.g. `CostGate.expected_tokens`) so an overconfident drafter does not win on its own word.
    """

    wants_target_features = True
    prefers_trees = True  # the engine's default, as for the drafter alone

    def __init__(self, suffix: Proposer, drafter: FeatureProposer, num_speculative_tokens: int = 16,
                 suffix_threshold: float | None = None, expected: Callable[[Proposal], float] | None = None) -> None:
        self.suffix, self.drafter = check_proposer(suffix), check_proposer(drafter)
        self.drafts_trees = suffix.drafts_trees and drafter.drafts_trees
        k = drafter.num_speculative_tokens  # the drafter drafts at most its own K; the suffix cache up to the budget
        self.suffix_threshold = float(k) if suffix_threshold is None else float(suffix_threshold)
        self.num_speculative_tokens = max(k, num_speculative_tokens)
        self.expected = expected or (lambda p: p.score)
        self.chosen: Counter[str] = Counter()  # steps won, by proposal source ("" = nothing to draft)
        self.sampling = False  # set_sampling: the drafter samples its drafts

    def set_sampling(self, probs_fn: Any, generator: Any) -> None:
        self.drafter.set_sampling(probs_fn, generator)
        self.sampling = probs_fn is not None

    def start_request(self, request_id: Hashable, prompt: Sequence[int], *, features: Any,
                      extends: Hashable | None = None) -> None:
        kwargs = {"extends": extends} if extends is not None else {}
        self.suffix.start_request(request_id, prompt, **kwargs)
        try:
            self.drafter.start_request(request_id, prompt, features=features, **kwargs)
        except BaseException:
            self.suffix.abort_request(request_id)
            raise

    def append(self, request_id: Hashable, tokens: Sequence[int], *, features: Any) -> None:
        self.suffix.append(request_id, tokens)
        self.drafter.append(request_id, tokens, features=features)

    def speculate(self, request_id: Hashable, num_speculative_tokens: int | None = None, *,
                  tree: bool = False) -> Proposal:
        """tree=True: both draft trees of at most num_speculative_tokens nodes (the drafter's no deeper than its K)."""
        budget = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        suffix = self.suffix.speculate(request_id, budget, tree=tree)
        drafted = None
        if not suffix_suffices(suffix, self.suffix_threshold, self.expected):
            drafted = self.drafter.speculate(
                request_id, budget if tree else min(budget, self.drafter.num_speculative_tokens), tree=tree)
        best = choose_draft(suffix, drafted, self.suffix_threshold, self.expected, sampling=self.sampling)
        self.chosen[best.source if len(best) else ""] += 1
        return best

    def finish_request(self, request_id: Hashable) -> None:
        self.suffix.finish_request(request_id)
        self.drafter.finish_request(request_id)

    def abort_request(self, request_id: Hashable) -> None:
        self.suffix.abort_request(request_id)
        self.drafter.abort_request(request_id)
