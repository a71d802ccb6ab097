"""hybridspec: speculative decoding for LLM agents.

Importing the package is cheap (no torch): `Engine` and the model-backed parts are loaded on first use.
"""
from __future__ import annotations

from hybridspec.errors import ContextLengthExceeded, InvalidParameter
from hybridspec.proposal import Proposal, Proposer

__version__ = "0.1.0"
__all__ = ["Proposal", "Proposer", "Engine", "SamplingOptions", "InvalidParameter", "ContextLengthExceeded",
           "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from hybridspec.runtime.engine import Engine

        return Engine
    if name == "SamplingOptions":
        from hybridspec.runtime.options import SamplingOptions

        return SamplingOptions
    raise AttributeError(f"module 'hybridspec' has no attribute {name!r}")
