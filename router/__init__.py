"""hybridspec.router: what a draft is worth verifying. Knows Proposals and costs, not models."""
from hybridspec.router.cost import DEFAULT_VERIFY_MS, VerifyCost

__all__ = ["DEFAULT_VERIFY_MS", "VerifyCost"]
