"""The router contract: what the engine asks of a router each step. A router decides (what of each draft to verify,
how many tokens a draft is expected to yield); it knows Proposals and costs, not models or who proposed them."""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from hybridspec.proposal import Proposal


class Router(Protocol):
    def __call__(self, proposals: Sequence[Proposal], contexts: Sequence[int]) -> list[Proposal]:
        """Per sequence (its proposal, its context length in tokens): the part of the draft worth verifying, a subtree
        of it (parents precede children), possibly empty."""
        ...

    def observe(self, proposals: Sequence[Proposal], accepted: Sequence[Sequence[int]]) -> None:
        """After verification: accepted[b] are the indices of the routed proposals[b]'s accepted nodes."""
        ...

    def expected_tokens(self, proposal: Proposal) -> float:
        """How many of the proposal's tokens are expected to be accepted (a hybrid picks its draft by it)."""
        ...

    def rate(self, proposal: Proposal, context: int) -> float:
        """Expected tokens per plain step's time of verifying the proposal as routed (1.0: a plain step); a hybrid
        compares its options by it."""
        ...

    def step_ms(self, context: int) -> float:
        """The ms of a plain decoding step at `context` tokens (a hybrid converts a drafter's cost with it)."""
        ...


# Optional: plan(proposals, contexts, other_tokens) -> proposals, the step's rows all at once with the prompt tokens
# its pass runs beside (`CostGate.plan`); a router without it is called call by call.
_MEMBERS = ("__call__", "observe", "expected_tokens", "rate", "step_ms")


def check_router(router: object) -> Router:
    """Return `router` if it has every member of the contract; else raise a TypeError naming what it lacks."""
    missing = [name for name in _MEMBERS if not callable(getattr(router, name, None))]
    if missing:
        raise TypeError(f"{type(router).__name__} is not a Router: it lacks {', '.join(missing)} (the contract is "
                        f"hybridspec.router.Router; a plain function (proposals, contexts) -> proposals is wrapped "
                        f"as a FunctionRouter)")
    return router  # type: ignore[return-value]


def as_router(router: Any) -> Router:
    """A Router from a router or a plain function (proposals, contexts) -> proposals."""
    if callable(router) and not hasattr(router, "observe") and not hasattr(router, "expected_tokens"):
        return FunctionRouter(router)
    return check_router(router)


class FunctionRouter:
    """A plain function (proposals, contexts) -> proposals as a `Router` that learns nothing, takes each proposal's
    own score as its expectation and the built-in verify costs as its costs."""

    def __init__(self, route: Callable[[Sequence[Proposal], Sequence[int]], list[Proposal]]) -> None:
        from hybridspec.router.cost import VerifyCost

        self.route = route
        self._cost = VerifyCost()

    def __call__(self, proposals: Sequence[Proposal], contexts: Sequence[int]) -> list[Proposal]:
        return self.route(proposals, contexts)

    def observe(self, proposals: Sequence[Proposal], accepted: Sequence[Sequence[int]]) -> None:
        pass

    def expected_tokens(self, proposal: Proposal) -> float:
        return float(proposal.score)

    def rate(self, proposal: Proposal, context: int) -> float:
        return (1.0 + self.expected_tokens(proposal)) / self._cost.relative(len(proposal))

    def step_ms(self, context: int) -> float:
        return float(self._cost(0))
