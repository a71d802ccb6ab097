"""The router contract: what the engine asks of a router each step. A router decides (what of each draft to verify,
how many tokens a draft is expected to yield); it knows Proposals and costs, not models or who proposed them.

One step, as the engine runs it:

    route = router.plan(proposals, contexts, other_tokens)   # every row's draft planned for the whole pass
    drafts = route.drafts(proposals)                          # what the pass verifies
    ...                                                       # the pass, the acceptance rule
    router.observe(drafts, accepted)                          # learn from what the target accepted
    # the next step's proposers get route.load (what a draft token cost in this pass) as a value
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from hybridspec.proposal import Proposal


@dataclass(frozen=True)
class StepLoad:
    """What a planned step of several rows (or of rows beside prompt tokens) costs: a row's share of the pass in ms
    (the unit a row's draft is priced in) and the tokens the pass runs. A hybrid prices its drafter by the load of the
    step before, which the engine passes to its next `speculate_many` (None: a row alone, priced by the tables)."""

    row_ms: float
    pass_tokens: int


@dataclass(frozen=True)
class Route:
    """A router's plan for one step: per row, the nodes of its draft worth verifying (increasing, closed under
    parents; empty: verify none), and the step's load (None: one row alone)."""

    keep: list[list[int]]
    load: StepLoad | None = None

    def drafts(self, proposals: Sequence[Proposal]) -> list[Proposal]:
        """Each row's draft as routed."""
        return [p.subset(k) for p, k in zip(proposals, self.keep)]


class Router(Protocol):
    def plan(self, proposals: Sequence[Proposal], contexts: Sequence[int], other_tokens: int = 0) -> Route:
        """Every row of one step at once (its proposal, its context length in tokens; other_tokens: the prompt tokens
        the pass runs beside): the part of each draft worth verifying, and the step's load."""
        ...

    def observe(self, proposals: Sequence[Proposal], accepted: Sequence[Sequence[int]]) -> None:
        """After verification: accepted[b] are the indices of the routed proposals[b]'s accepted nodes."""
        ...

    def expected_tokens(self, proposal: Proposal) -> float:
        """How many of the proposal's tokens are expected to be accepted (a hybrid picks its draft by it)."""
        ...

    def rate(self, proposal: Proposal, context: int, load: StepLoad | None = None) -> float:
        """Expected tokens per plain step's time of verifying the proposal as routed (1.0: a plain step), in a step
        of `load` (None: a row alone); a hybrid compares its options by it."""
        ...

    def step_ms(self, context: int, load: StepLoad | None = None) -> float:
        """The ms of a plain decoding step at `context` tokens, or a row's share of a step of `load` (a hybrid
        converts a drafter's cost with it)."""
        ...


_MEMBERS = ("plan", "observe", "expected_tokens", "rate", "step_ms")


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
    if callable(router) and not any(hasattr(router, name) for name in _MEMBERS):
        return FunctionRouter(router)
    return check_router(router)


class FunctionRouter:
    """A plain function (proposals, contexts) -> proposals, each a subtree of its proposal, as a `Router` that learns
    nothing, takes each proposal's own score as its expectation and the built-in verify costs as its costs."""

    def __init__(self, route: Callable[[Sequence[Proposal], Sequence[int]], list[Proposal]]) -> None:
        from hybridspec.router.cost import VerifyCost

        self.route = route
        self._cost = VerifyCost()

    def plan(self, proposals: Sequence[Proposal], contexts: Sequence[int], other_tokens: int = 0) -> Route:
        routed = self.route(proposals, contexts)
        if len(routed) != len(proposals):
            raise ValueError(f"the router returned {len(routed)} proposals for {len(proposals)} sequences")
        return Route([kept_nodes(p, r) for p, r in zip(proposals, routed)])

    def observe(self, proposals: Sequence[Proposal], accepted: Sequence[Sequence[int]]) -> None:
        pass

    def expected_tokens(self, proposal: Proposal) -> float:
        return float(proposal.score)

    def rate(self, proposal: Proposal, context: int, load: StepLoad | None = None) -> float:
        return (1.0 + self.expected_tokens(proposal)) / self._cost.relative(len(proposal))

    def step_ms(self, context: int, load: StepLoad | None = None) -> float:
        return float(self._cost(0))


def kept_nodes(proposal: Proposal, routed: Proposal) -> list[int]:
    """The nodes of `proposal` that `routed`, a subtree of it, keeps (matched by parent and token, in order)."""
    if routed is proposal or (routed.token_ids == proposal.token_ids and routed.parents == proposal.parents):
        return list(range(len(proposal)))
    keep: list[int] = []
    start = 0
    for token, parent in zip(routed.token_ids, routed.parents):
        want = keep[parent] if parent >= 0 else -1
        j = next((j for j in range(start, len(proposal))
                  if proposal.token_ids[j] == token and proposal.parents[j] == want), None)
        if j is None:
            raise ValueError("the router returned a draft that is not a subtree of the proposal")
        keep.append(j)
        start = j + 1
    return keep
