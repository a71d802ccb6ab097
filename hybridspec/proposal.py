"""The one type every proposer returns and the router and verifier consume.

Kept free of heavy imports (no torch, no numpy) so that `hybridspec.suffix` can depend on it alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol, Sequence


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
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] | None = None
    score: float = 0.0
    source: str = ""
    match_len: int = 0
    draft_logits: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

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


class Proposer(Protocol):
    """The request life cycle every model-free proposer follows (the suffix cache, n-gram, the Arctic adapter).

    A request starts with its prompt (optionally declaring that the prompt extends an earlier request's prompt and
    response, so only new tokens are indexed), grows by the tokens the verifier accepted, and is finished.
    """

    def start_request(self, request_id: Hashable, prompt: Sequence[int], *, extends: Hashable | None = None) -> None: ...

    def append(self, request_id: Hashable, tokens: Sequence[int]) -> None: ...

    def speculate(self, request_id: Hashable, max_spec_tokens: int | None = None) -> Proposal: ...

    def finish_request(self, request_id: Hashable) -> None: ...
