"""hybridspec.suffix: model-free proposers (suffix tree, n-gram). No torch here.

`NgramProposer` is imported on first use: it brings numba (and llvmlite), which a process need not load for the suffix
cache alone; vLLM 0.32's CPU worker, which scans every loaded module's objects at start-up, fails on llvmlite's.
"""
from hybridspec.suffix.cache import SuffixCache, SuffixCacheFileError

__all__ = ["SuffixCache", "SuffixCacheFileError", "NgramProposer"]


def __getattr__(name: str):
    if name == "NgramProposer":
        from hybridspec.suffix.ngram import NgramProposer

        return NgramProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
