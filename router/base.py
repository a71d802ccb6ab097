"""The router contract: what the engine calls to decide how much of each draft a verification pass takes."""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

from hybridspec.proposal import Proposal


@runtime_checkable
class Router(Protocol):
    def __call__(self, proposals: Sequence[Proposal], contexts: Sequence[int]) -> list[Proposal]:
        """Per sequence (its proposal, its context length in tokens): the part of the draft worth verifying, a subtree
        of it (parents precede children), possibly empty."""
        ...

    def observe(self, proposals: Sequence[Proposal], accepted: Sequence[Sequence[int]]) -> None:
        """After verification: accepted[b] are the indices of the routed proposals[b]'s accepted nodes."""
        ...


class FunctionRouter:
    """A plain function (proposals, contexts) -> proposals as a `Router` that learns nothing."""

    def __init__(self, route: Callable[[Sequence[Proposal], Sequence[int]], list[Proposal]]) -> None:
        self.route = route

    def __call__(self, proposals: Sequence[Proposal], contexts: Sequence[int]) -> list[Proposal]:
        return self.route(proposals, contexts)

    def observe(self, proposals: Sequence[Proposal], accepted: Sequence[Sequence[int]]) -> None:
        pass
