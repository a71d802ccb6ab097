"""The one type every proposer returns and the router and verifier consume (`Proposal`), and the contract every proposer
keeps (`Proposer` for model-free ones, `FeatureProposer` for those that read the target's hidden states).

Kept free of heavy imports (no torch, no numpy) so that `hybridspec.suffix` can depend on it alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Literal, Protocol, Sequence


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one sequence, as a chain or a tree.

    token_ids[i] is a draft token whose parent is parents[i] (-1: it follows the last verified token); a chain has
    parents [-1, 0, 1, ...]. Parents always precede their children.
    probs[i] is the proposer's estimate that token i is accepted, i.e. its whole path from the root (suffix: the path
    frequency; a drafter: the product of its token probabilities), used by the router; score is the expected number
    of accepted tokens (sum of probs).
    draft_logits are the drafter's raw next-token logits per token ([n, vocab] tensor) for lossless rejection sampling:
    the verifier applies the same temperature/top-k/top-p to them as to the target, and a sampling drafter must draw its
    tokens from that processed distribution. None for deterministic proposers (suffix, n-gram): one-hot drafts.
    drafter_ran: a model drafter ran to make this proposal (a hybrid's may come from its suffix cache all the same).
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] | None = None
    score: float = 0.0
    source: str = ""
    match_len: int = 0
    draft_logits: Any = None
    drafter_ran: bool = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def check(self, vocab_size: int) -> None:
        """Raise ValueError unless the proposal is a well-formed tree over [0, vocab_size): one parent per token, every
        parent before its child."""
        n = len(self.token_ids)
        if len(self.parents) != n:
            raise ValueError(f"{n} token_ids but {len(self.parents)} parents")
        for i, (token, parent) in enumerate(zip(self.token_ids, self.parents)):
            if not -1 <= parent < i:
                raise ValueError(f"parents[{i}] = {parent}; parents must precede their children (-1 <= parents[i] < i)")
            if not 0 <= token < vocab_size:
                raise ValueError(f"token_ids[{i}] = {token} is outside the vocabulary [0, {vocab_size})")

    def subset(self, keep: Sequence[int]) -> "Proposal":
        """The proposal restricted to the nodes `keep` (increasing, closed under parents), parents renumbered; score
        is the kept nodes' probs summed (1 each where the proposer gives none). Itself where it keeps every node."""
        if len(keep) == len(self.token_ids):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        probs = [self.probs[i] for i in keep] if self.probs is not None else None
        logits = self.draft_logits[list(keep)] if self.draft_logits is not None and len(keep) else None
        return Proposal(token_ids=[self.token_ids[i] for i in keep],
                        parents=[new_index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
                        probs=probs, score=float(sum(probs)) if probs is not None else float(len(keep)),
                        source=self.source, match_len=self.match_len, draft_logits=logits,
                        drafter_ran=self.drafter_ran)

    @classmethod
    def empty(cls, source: str = "") -> "Proposal":
        return cls(token_ids=[], parents=[], probs=[], score=0.0, source=source)

    @classmethod
    def chain(cls, token_ids: Sequence[int], probs: Sequence[float] | None = None, source: str = "",
              match_len: int = 0, draft_logits: Any = None) -> "Proposal":
        ids = [int(t) for t in token_ids]
        p = [float(x) for x in probs] if probs is not None else [1.0] * len(ids)
        return cls(token_ids=ids, parents=list(range(-1, len(ids) - 1)), probs=p, score=float(sum(p)),
                   source=source, match_len=match_len, draft_logits=draft_logits)


# ---------------------------------------------------------------------------------------------------------------------
# The proposer contract: everything the engine (and the replay, the vLLM plugin) calls on a proposer. A proposer is
# any object with these members; it need not inherit from these classes.


class _ProposerBase(Protocol):
    """The part of the contract that model-free proposers and model drafters share."""

    # -- read by the engine
    num_speculative_tokens: int  # the draft budget `speculate` uses when it is passed None
    drafts_trees: bool  # speculate(..., tree=True) drafts a token tree; if False the engine never asks for one
    prefers_trees: bool  # with tree=None (the default) the engine asks this proposer for trees
    wants_target_features: bool  # start_request and append take the target's hidden states (features=)

    def speculate(self, request_id: Hashable, num_speculative_tokens: int | None = None, *,
                  tree: bool = False) -> Proposal:
        """Draft what follows the request's tokens: at most num_speculative_tokens nodes (None: the default; 0: an
        empty Proposal), a chain, or a tree when tree=True. Parents precede children; probs lie in [0, 1]."""
        ...

    def finish_request(self, request_id: Hashable) -> None:
        """The request ended normally: its tokens may serve later requests (a global index, `extends=`)."""
        ...

    def abort_request(self, request_id: Hashable) -> None:
        """The request ended early (cancelled, failed): forget it; nothing of it is kept."""
        ...


class Proposer(_ProposerBase, Protocol):
    """A model-free proposer (the suffix cache, n-gram, the ArcticInference adapter): drafts from tokens alone.

    Life cycle of a request: start_request -> (speculate -> append)* -> finish_request or abort_request. Unknown or
    already-ended request ids raise KeyError; starting a running id again raises ValueError.
    """

    wants_target_features: Literal[False]

    def start_request(self, request_id: Hashable, prompt: Sequence[int], *,
                      extends: Hashable | None = None) -> None:
        """Begin a request with its prompt. extends: a finished request whose prompt + response this prompt
        continues (an agent's next turn), so only the new tokens need indexing; a mismatch indexes the whole prompt."""
        ...

    def append(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """The tokens one step committed: the accepted draft tokens and the target's own next token."""
        ...


class FeatureProposer(_ProposerBase, Protocol):
    """A proposer that reads the target model's hidden states (a model drafter, the suffix + drafter hybrid).

    The same life cycle as `Proposer`; start_request and append also take the target's features at the positions
    that produced the given tokens (`hybridspec.speculators.TargetFeatures`), and the engine sets the sampling
    before each call, so drafts come from the distribution the verifier assumes.
    """

    wants_target_features: Literal[True]
    # Optional: True where start_request takes features=None and prompt_features(rid, features) gives them later,
    # before the request's first append (the engine then runs a prompt with the request's first step). Meanwhile
    # speculate drafts from what needs no features, or nothing.
    late_prompt_features: bool

    # Optional: speculate_many(request_ids, budgets, *, tree=False, load=None) -> list[Proposal], what speculate gives
    # for each request, drafted together (a model drafter: one pass for all of them). The engine asks for the drafts
    # of every sequence it steps at once where a proposer has it (`speculate_each`), with the last step's
    # `hybridspec.router.StepLoad` (what a draft token cost in it; None: a row alone), by which a hybrid decides
    # whether its drafter pays.

    def set_sampling(self, probs_fn: Callable[[Any], Any] | None, generator: Any = None) -> None:
        """probs_fn: logits -> the verifier's probabilities (temperature, top-k, top-p), None for greedy drafts;
        generator: the torch.Generator that sampled drafts draw from."""
        ...

    def start_request(self, request_id: Hashable, prompt: Sequence[int], *, features: Any,
                      extends: Hashable | None = None) -> None:
        """Begin a request; features: one row per prompt position before the last (or the last len(features)).
        features=None only where late_prompt_features is True: they come with prompt_features."""
        ...

    def append(self, request_id: Hashable, tokens: Sequence[int], *, features: Any) -> None:
        """The tokens one step committed, with the features of the positions that produced them (one row each)."""
        ...


_ATTRIBUTES = ("num_speculative_tokens", "drafts_trees", "prefers_trees", "wants_target_features")
_METHODS = ("start_request", "append", "speculate", "finish_request", "abort_request")


def check_proposer(proposer: object) -> Proposer | FeatureProposer:
    """Return `proposer` if it has every member of the contract; else raise a TypeError naming what it lacks."""
    wants = getattr(proposer, "wants_target_features", False) is True
    needed = _ATTRIBUTES + _METHODS + (("set_sampling",) if wants else ())
    needed += ("prompt_features",) if wants and getattr(proposer, "late_prompt_features", False) else ()
    missing = [name for name in needed if not hasattr(proposer, name)]
    if missing:
        contract = "FeatureProposer" if wants else "Proposer"
        raise TypeError(f"{type(proposer).__name__} is not a {contract}: it lacks {', '.join(missing)} (the contract "
                        f"is hybridspec.proposal.{contract})")
    return proposer  # type: ignore[return-value]


def speculate_each(proposer: Proposer | FeatureProposer, request_ids: Sequence[Hashable],
                   budgets: Sequence[int | None], *, tree: bool = False, load: Any = None) -> list[Proposal]:
    """Each request's draft: in one batch where the proposer drafts several at once (`speculate_many`; a
    FeatureProposer's with the step's `load`), else one by one."""
    many = getattr(proposer, "speculate_many", None)
    if many is None:
        return [proposer.speculate(rid, budget, tree=tree) for rid, budget in zip(request_ids, budgets)]
    if proposer.wants_target_features:
        return many(request_ids, budgets, tree=tree, load=load)
    return many(request_ids, budgets, tree=tree)
