"""hybridspec.suffix: model-free proposers (suffix tree, n-gram). No torch here."""
from hybridspec.suffix.cache import SuffixCache, SuffixCacheFileError
from hybridspec.suffix.ngram import NgramProposer

__all__ = ["SuffixCache", "SuffixCacheFileError", "NgramProposer"]
