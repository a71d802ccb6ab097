"""hybridspec.router: the decisions of a step. What of each draft is worth a verification pass (`CostGate`, over the
verify-cost model of `cost`), how many tokens a draft is expected to yield, and which draft wins where two proposers
draft (`choose_draft`, `HybridProposer`). Knows Proposals and costs, not models: the `Router` contract in `base`."""
from hybridspec.router.base import FunctionRouter, Route, Router, StepLoad, as_router, check_router
from hybridspec.router.cost import DEFAULT_VERIFY_MS, DEFAULT_VERIFY_MS_BY_CONTEXT, DraftCost, VerifyCost
from hybridspec.router.gate import CostGate, verify_costs_by_context
from hybridspec.router.hybrid import (DrafterEstimate, HybridProposer, choose_draft, drafter_pays, drafter_step_pays,
                                     positional_chain)

__all__ = ["DEFAULT_VERIFY_MS", "DEFAULT_VERIFY_MS_BY_CONTEXT", "VerifyCost", "CostGate", "HybridProposer", "Router",
           "FunctionRouter", "Route", "StepLoad", "as_router", "check_router", "verify_costs_by_context",
           "choose_draft", "drafter_pays", "drafter_step_pays", "DraftCost", "DrafterEstimate", "positional_chain"]
