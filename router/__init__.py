"""hybridspec.router: what a draft is worth verifying. Knows Proposals and costs, not models."""
from hybridspec.router.base import FunctionRouter, Router, as_router, check_router
from hybridspec.router.cost import DEFAULT_VERIFY_MS, DEFAULT_VERIFY_MS_BY_CONTEXT, VerifyCost
from hybridspec.router.gate import CostGate, verify_costs_by_context
from hybridspec.router.hybrid import HybridProposer, choose_draft, suffix_suffices

__all__ = ["DEFAULT_VERIFY_MS", "DEFAULT_VERIFY_MS_BY_CONTEXT", "VerifyCost", "CostGate", "HybridProposer", "Router",
           "FunctionRouter", "as_router", "check_router", "verify_costs_by_context", "choose_draft", "suffix_suffices"]
