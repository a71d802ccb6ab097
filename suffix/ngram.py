"""Prompt-lookup (n-gram) proposer: the model-free baseline, and a cheap proposer the router can pick.

For each request we keep its token context (prompt + accepted tokens). A draft is found as vLLM's NgramProposer finds
one: the longest n in [min_n, max_n] such that the context's last n tokens occur earlier in the context, then up to k
tokens that followed that occurrence are copied. Unlike vLLM, which takes the *earliest* occurrence of the longest
n-gram, we take the *most recent* one: in agent loops the latest copy of a file or message is the one being re-emitted.

Not thread-safe: one caller at a time (the engine drives proposers from one thread).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

import numpy as np
from numba import njit

from hybridspec.proposal import Proposal
from hybridspec.suffix.cache import as_token_array


@njit(cache=True, nogil=True)
def _longest_recent_match(ctx: np.ndarray, length: int, min_n: int, max_n: int) -> tuple[int, int]:
    """(position after the match, n) for the most recent earlier occurrence of the longest suffix of ctx[:length]
    with n in [min_n, max_n]; (-1, 0) if none. One backward pass, early exit once a max-length match is found."""
    limit = min(max_n, length - 1)  # an earlier occurrence ends at least one token before the context does
    if limit < min_n:
        return -1, 0
    last = ctx[length - 1]
    best_n = 0
    best_end = -1
    for e in range(length - 2, -1, -1):
        if ctx[e] != last:
            continue
        cap = min(limit, e + 1)
        m = 1
        while m < cap and ctx[e - m] == ctx[length - 1 - m]:
            m += 1
        if m > best_n:  # strictly longer: among equal lengths the most recent (first seen) wins
            best_n = m
            best_end = e
            if m == limit:
                break
    if best_n < min_n:
        return -1, 0
    return best_end + 1, best_n


def resolve_num_speculative_tokens(value: int | None, default: int) -> int:
    """The draft length to use: `default` for None; 0 means no draft; a negative or non-integer value is an error."""
    k = default if value is None else value
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"num_speculative_tokens must be an int or None, got {type(value).__name__}")
    if k < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
    return int(k)


class TokenBuffer:
    """A growable int32 token buffer (a request's context): appends are amortised O(new tokens)."""

    __slots__ = ("buf", "length")

    def __init__(self, tokens: np.ndarray):
        # room for a response of a quarter of the prompt before the first regrowth
        self.buf = np.empty(len(tokens) + max(64, len(tokens) // 4), dtype=np.int32)
        self.buf[: len(tokens)] = tokens
        self.length = len(tokens)

    def extend(self, tokens: np.ndarray) -> None:
        need = self.length + len(tokens)
        if need > len(self.buf):
            grown = np.empty(max(need, 2 * len(self.buf)), dtype=np.int32)
            grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        self.buf[self.length : need] = tokens
        self.length = need

    def view(self) -> np.ndarray:
        return self.buf[: self.length]


class NgramProposer:
    """vLLM-style prompt lookup over each request's own context; a `hybridspec.proposal.Proposer`.

    Drafts are deterministic (probs 1.0 per token, so score = draft length). Finished requests' contexts are kept
    (the `max_retained` most recent) so that a later request whose prompt extends one (`extends=`) reuses its buffer
    and copies only the new tokens.
    """

    drafts_trees = False
    prefers_trees = False
    wants_target_features = False

    def __init__(self, min_n: int = 2, max_n: int = 5, num_speculative_tokens: int = 16, max_retained: int = 256):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if max_retained < 0:
            raise ValueError(f"max_retained must be >= 0, got {max_retained}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_speculative_tokens = num_speculative_tokens
        self.max_retained = max_retained
        self._active: dict[Hashable, TokenBuffer] = {}
        self._retained: OrderedDict[Hashable, TokenBuffer] = OrderedDict()

    def start_request(self, request_id: Hashable, prompt: Sequence[int] | np.ndarray, *,
                      extends: Hashable | None = None) -> None:
        """Start a request. With `extends` naming a finished (retained) request whose context is a prefix of `prompt`,
        that context is taken over and only the new tokens are copied; otherwise the whole prompt is."""
        if request_id in self._active:
            raise ValueError(f"request {request_id!r} is already active")
        if extends in self._active:
            raise ValueError(f"request {extends!r} has not finished: finish it before extending it")
        tokens = as_token_array(prompt)
        base = self._retained.pop(extends, None) if extends is not None else None
        self._retained.pop(request_id, None)  # a reused id: its old context is stale
        if base is not None and base.length <= len(tokens) and np.array_equal(base.view(), tokens[: base.length]):
            base.extend(tokens[base.length :])
            self._active[request_id] = base
        else:
            self._active[request_id] = TokenBuffer(tokens)

    def append(self, request_id: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        """Append accepted tokens to the request's context."""
        ctx = self._get(request_id)
        ctx.extend(as_token_array(tokens))

    def speculate(self, request_id: Hashable, num_speculative_tokens: int | None = None, *,
                  tree: bool = False) -> Proposal:
        """Draft a chain: the tokens that followed the most recent earlier occurrence of the longest context suffix
        with n in [min_n, max_n]. `num_speculative_tokens` None: the default; 0: an empty proposal."""
        if tree:
            raise ValueError("NgramProposer drafts chains only (drafts_trees is False)")
        ctx = self._get(request_id)
        k = resolve_num_speculative_tokens(num_speculative_tokens, self.num_speculative_tokens)
        if k == 0:
            return Proposal.empty(source="ngram")
        start, n = _longest_recent_match(ctx.buf, ctx.length, self.min_n, self.max_n)
        if n == 0:
            return Proposal.empty(source="ngram")
        draft = ctx.buf[start : min(start + k, ctx.length)].tolist()
        return Proposal.chain(draft, source="ngram", match_len=n)

    def finish_request(self, request_id: Hashable) -> None:
        """End a request; its context is retained for a later `extends`."""
        ctx = self._get(request_id)
        del self._active[request_id]
        if self.max_retained > 0:
            self._retained[request_id] = ctx
            while len(self._retained) > self.max_retained:
                self._retained.popitem(last=False)

    def abort_request(self, request_id: Hashable) -> None:
        """Drop a request without retaining its context."""
        self._get(request_id)
        del self._active[request_id]

    def context(self, request_id: Hashable) -> np.ndarray:
        """The active request's context (prompt + appended tokens), read-only."""
        view = self._get(request_id).view()
        view.flags.writeable = False
        return view

    def memory_bytes(self) -> int:
        """Bytes held by the token buffers of active and retained requests."""
        return sum(c.buf.nbytes for c in self._contexts())

    def indexed_tokens(self) -> int:
        """Tokens held for active and retained requests."""
        return sum(c.length for c in self._contexts())

    def _contexts(self) -> list[TokenBuffer]:
        return [*self._active.values(), *self._retained.values()]

    def _get(self, request_id: Hashable) -> TokenBuffer:
        ctx = self._active.get(request_id)
        if ctx is None:
            raise KeyError(f"unknown request {request_id!r}: not started, or already finished or aborted")
        return ctx
