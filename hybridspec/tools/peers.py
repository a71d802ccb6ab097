"""Adapters that put peer projects' proposers behind our `Proposer` life cycle, for side-by-side benchmarks.

`ArcticSuffixProposer` wraps ArcticInference's `SuffixDecodingCache` and drives it as vLLM's `method: "suffix"`
does: the prompt enters a per-request tree at start, accepted tokens are added as the active response (which the peer
also indexes in its global tree at once), and each speculation passes the last `max_depth` tokens of the context.
arctic-inference lives in its own environment (`scripts/setup_peers.sh` creates `.venv-peers`); it is imported when an
adapter is constructed, so this module imports anywhere.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from hybridspec.proposal import Proposal
from hybridspec.suffix.cache import as_token_array
from hybridspec.suffix.ngram import TokenBuffer, resolve_num_speculative_tokens


class ArcticSuffixProposer:
    """ArcticInference's suffix decoding (`arctic_inference.suffix_decoding.SuffixDecodingCache`) as a `Proposer`.

    The peer has no session API: `extends` is accepted for interface parity and the full prompt is indexed again.
    `max_spec_tokens` is always passed to the peer (0.3.0 crashes on None, and reads 0 as "max_depth"): None means
    this adapter's default and 0 gives an empty proposal, as for our proposers.
    """

    source = "arctic-suffix"
    drafts_trees = True
    wants_target_features = False

    def __init__(self, max_depth: int = 64, num_speculative_tokens: int = 16, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, max_cached_requests: int = 10_000,
                 prefers_trees: bool = False):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as e:
            raise ImportError("ArcticSuffixProposer needs arctic-inference, installed in its own environment by "
                              "scripts/setup_peers.sh (run this under .venv-peers/bin/python)") from e
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if max_cached_requests == 0 or max_cached_requests < -1:
            raise ValueError(f"max_cached_requests must be positive or -1 (no limit), got {max_cached_requests}")
        self.max_depth = max_depth
        self.num_speculative_tokens = num_speculative_tokens
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.prefers_trees = prefers_trees  # the engine's default shape; speculate(tree=) decides per call
        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached_requests)
        # the peer takes the matching context with every call; vLLM slices it from its token buffer the same way
        self._contexts: dict[Hashable, TokenBuffer] = {}
        self._response_tokens: dict[Hashable, int] = {}  # per request in the peer's global tree, for indexed_tokens()

    def start_request(self, request_id: Hashable, prompt: Sequence[int] | np.ndarray, *,
                      extends: Hashable | None = None) -> None:
        if request_id in self._contexts:
            raise ValueError(f"request {request_id!r} is already active")
        tokens = as_token_array(prompt)
        self.cache.start_request(request_id, tokens)  # may evict older responses from the peer's global tree
        self._contexts[request_id] = TokenBuffer(tokens)
        self._response_tokens[request_id] = 0
        if len(self._response_tokens) > 2 * len(self.cache.cached_requests) + 64:  # amortised O(1) per request
            self._forget_evicted()

    def append(self, request_id: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        ctx = self._get(request_id)
        arr = as_token_array(tokens)
        self.cache.add_active_response(request_id, arr)
        ctx.extend(arr)
        self._response_tokens[request_id] += len(arr)

    def speculate(self, request_id: Hashable, num_speculative_tokens: int | None = None, *,
                  tree: bool = False) -> Proposal:
        ctx = self._get(request_id)
        k = resolve_num_speculative_tokens(num_speculative_tokens, self.num_speculative_tokens)
        if k == 0:
            return Proposal.empty(source=self.source)
        context = ctx.buf[max(0, ctx.length - self.max_depth) : ctx.length]
        d = self.cache.speculate(request_id, context, max_spec_tokens=k, max_spec_factor=self.max_spec_factor,
                                 max_spec_offset=self.max_spec_offset, min_token_prob=self.min_token_prob,
                                 use_tree_spec=tree)
        return Proposal(token_ids=list(d.token_ids), parents=list(d.parents), probs=list(d.probs), score=d.score,
                        source=self.source, match_len=d.match_len if d.token_ids else 0)

    def finish_request(self, request_id: Hashable) -> None:
        """End a request; its response stays in the peer's global tree (it entered it while being generated)."""
        self._get(request_id)
        self.cache.stop_request(request_id)
        del self._contexts[request_id]

    def abort_request(self, request_id: Hashable) -> None:
        """End a request and drop its response from the global tree."""
        self.finish_request(request_id)
        if request_id in self.cache.cached_requests:
            self.cache.evict_cached_response(request_id)

    def memory_bytes(self) -> int:
        """The peer's own estimate (`SuffixTree.estimate_memory`) over its global and per-request trees."""
        trees = [self.cache._global_tree, *self.cache._local_trees.values()]
        return sum(t.estimate_memory() for t in trees)

    def indexed_tokens(self) -> int:
        """Tokens in the per-request trees (contexts) and in the global tree (responses not yet evicted)."""
        self._forget_evicted()
        return sum(c.length for c in self._contexts.values()) + sum(self._response_tokens.values())

    def _forget_evicted(self) -> None:
        cached = self.cache.cached_requests
        self._response_tokens = {r: n for r, n in self._response_tokens.items() if r in cached}

    def _get(self, request_id: Hashable) -> TokenBuffer:
        ctx = self._contexts.get(request_id)
        if ctx is None:
            raise KeyError(f"unknown request {request_id!r}: not started, or already finished or aborted")
        return ctx
