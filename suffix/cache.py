"""SuffixCache: the suffix proposer's Python face over the compiled tree (`_tree.pyx`).

Two levels, as in SuffixDecoding: every request has its own tree over its prompt and output so far, and one global tree
holds finished responses, each after the last `prompt_tail_tokens` tokens of its prompt (all of the prompt with
`index_prompts_globally`). `speculate` drafts from both. A chain also drafts from the request's output alone, which
catches a response repeating itself where the prompt's occurrences of the same string would outvote it in the
request's tree; it keeps the highest-scoring of the three (ties: own, global, output). A tree is the union of the two
trees' drafts (a path drafted twice at the higher of its probabilities), where each tree also drafts from its longest
shorter match that occurs more often than the longest (a backoff: continuations the long match does not reach), cut to
the node budget by probability.

Semantics (the brute-force reference in tests/suffix_reference.py implements exactly these):
- counts are exact occurrence counts of strings up to `max_depth` tokens; a token's probability is its share among the
  continuations of the matched string (occurrences with no next token, like the context's own end, do not vote);
  ties go to the most recent occurrence; a draft's probabilities are cumulative along its path and it stops below
  `min_token_prob`; score = sum of probabilities (expected accepted tokens);
- the match is the longest suffix of the context (at most `max_depth`) with an earlier occurrence (own tree; for the
  output draft, the longest suffix of the output with an earlier occurrence in it) or any occurrence (global tree); the
  draft may be at most `max_spec_factor * match_len + max_spec_offset` tokens long;
- past `max_depth` the tree knows no more, and the draft continues by copying from the most recent occurrence of the
  last `max_depth` tokens; copies may overlap the draft itself (periodic text), as in LZ77.

Thread safety: every public method takes the cache's lock, so one cache may be shared between threads; drafting
releases the GIL, so other Python threads run meanwhile. Proposals are plain objects owned by the caller.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

import numpy as np

from hybridspec.proposal import Proposal
from hybridspec.suffix import _tree

_MAGIC = b"HSPXSUF\x00"
_FORMAT_VERSION = 1
_INT32_MAX = 2**31 - 1
APPEND_EVICT_DIVISOR = 8  # an append evicts at most evict_per_call / 8 suffixes: steps stay cheap, finishes catch up


class SuffixCacheFileError(ValueError):
    """A saved cache file is truncated, corrupt, foreign or of an unsupported version."""


def as_token_array(tokens: Sequence[int] | np.ndarray, vocab_size: int | None = None) -> np.ndarray:
    """Validate token ids and return them as a contiguous int32 array (a clear error for anything else)."""
    return _tree.as_tokens(tokens, _INT32_MAX if vocab_size is None else vocab_size - 1)


class SuffixCache:
    """Model-free proposer over prompts and past responses (see the module docstring for the exact semantics); a
    `hybridspec.proposal.Proposer`.

    Life cycle of a request: `start_request(rid, prompt)`; per step `speculate(rid)`, then `append(rid, accepted)`;
    `finish_request(rid)` moves its response into the global tree. An agent loop that re-sends the conversation passes
    `extends=previous_rid`: when the new prompt begins with that request's prompt + response, its tree is taken over
    and only the new tokens are indexed (otherwise the prompt is indexed afresh; `stats()` counts both).
    """

    drafts_trees = True
    prefers_trees = False  # on a CPU a long chain verifies cheaper than a tree of the same size (BENCHMARKS.md)
    wants_target_features = False

    def __init__(
        self,
        max_depth: int = 64,
        num_speculative_tokens: int = 16,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        global_budget_tokens: int = 4_000_000,
        index_prompts_globally: bool = False,
        max_retained: int = 256,
        retained_budget_tokens: int = 4_000_000,
        vocab_size: int | None = None,
        evict_per_call: int = 1024,
        prompt_tail_tokens: int = 16,
    ) -> None:
        if not 1 <= max_depth <= 65535:
            raise ValueError(f"max_depth must be in [1, 65535], got {max_depth}")
        if global_budget_tokens < 0 or retained_budget_tokens < 0 or max_retained < 0:
            raise ValueError("budgets must be >= 0")
        if prompt_tail_tokens < 0:
            raise ValueError(f"prompt_tail_tokens must be >= 0, got {prompt_tail_tokens}")
        if evict_per_call < 1:
            raise ValueError("evict_per_call must be >= 1")
        if vocab_size is not None and not 1 <= vocab_size <= _INT32_MAX:
            raise ValueError(f"vocab_size must be in [1, {_INT32_MAX}], got {vocab_size}")
        self.max_depth = max_depth
        self.defaults = dict(num_speculative_tokens=num_speculative_tokens, max_spec_factor=max_spec_factor,
                             max_spec_offset=max_spec_offset, min_token_prob=min_token_prob)
        self._check_spec_args(num_speculative_tokens, max_spec_factor, max_spec_offset, min_token_prob, None)
        self._resolved: tuple = (None, None)   # the last speculate options and what they resolved to
        self.global_budget_tokens = global_budget_tokens
        self.index_prompts_globally = index_prompts_globally
        self.max_retained = max_retained
        self.retained_budget_tokens = retained_budget_tokens
        self.vocab_size = vocab_size
        self.evict_per_call = evict_per_call
        self.prompt_tail_tokens = prompt_tail_tokens
        self._global = _tree.SuffixTree(max_depth)
        self._live: dict[Hashable, _tree.RequestState] = {}
        self._retained: OrderedDict[Hashable, _tree.RequestState] = OrderedDict()
        self._retained_tokens = 0
        self._lock = threading.RLock()
        self._counters = dict(session_hits=0, session_misses=0, evicted_tokens=0, finished_requests=0)

    @property
    def num_speculative_tokens(self) -> int:
        return self.defaults["num_speculative_tokens"]

    # ---------------------------------------------------------------- request life cycle

    def start_request(self, request_id: Hashable, prompt: Sequence[int] | np.ndarray, *,
                      extends: Hashable | None = None) -> None:
        toks = as_token_array(prompt, self.vocab_size)
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} is already running")
            state = None
            if extends is not None:
                if extends in self._live:
                    raise ValueError(f"request {extends!r} has not finished: finish it before extending it")
                prev = self._retained.pop(extends, None)
                if prev is not None:
                    self._retained_tokens -= prev.length
                    if prev.tree.starts_with_context(toks):
                        state = _tree.RequestState(prev.tree, len(toks), prev.length)
                        prev.tree.extend(toks[prev.length:])
                self._counters["session_hits" if state is not None else "session_misses"] += 1
            if state is None:
                tree = _tree.SuffixTree(self.max_depth)
                tree.add_sequence(toks, keep_open=True)
                state = _tree.RequestState(tree, len(toks), 0)
            # a retained request of the same id is superseded
            old = self._retained.pop(request_id, None)
            if old is not None:
                self._retained_tokens -= old.length
            self._live[request_id] = state

    def append(self, request_id: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        toks = as_token_array(tokens, self.vocab_size)
        with self._lock:
            self._state(request_id).extend(toks)
            self._evict_global(self.evict_per_call // APPEND_EVICT_DIVISOR)

    def finish_request(self, request_id: Hashable) -> None:
        """The request's response enters the global tree, after the prompt's last `prompt_tail_tokens` tokens (or
        after all of the newly indexed prompt, with index_prompts_globally)."""
        with self._lock:
            state = self._state(request_id)
            del self._live[request_id]
            state.finished = True
            # a response enters with the prompt tokens just before it, so a re-sent prompt (agent retries) matches
            # them and its earlier response is drafted from the first step
            new = state.tokens(state.indexed_from if self.index_prompts_globally
                               else max(0, state.prompt_len - self.prompt_tail_tokens))
            if len(new):
                self._global.add_sequence(new)
                self._evict_global(self.evict_per_call + len(new))
            self._counters["finished_requests"] += 1
            if self.max_retained > 0:
                self._retained[request_id] = state
                self._retained_tokens += state.length
                while self._retained and (len(self._retained) > self.max_retained
                                          or self._retained_tokens > self.retained_budget_tokens):
                    _, dropped = self._retained.popitem(last=False)
                    self._retained_tokens -= dropped.length

    def abort_request(self, request_id: Hashable) -> None:
        """Forget a request without adding anything to the global tree."""
        with self._lock:
            self._state(request_id)
            del self._live[request_id]

    # ---------------------------------------------------------------- proposals

    def speculate(self, request_id: Hashable, num_speculative_tokens: int | None = None, *, tree: bool = False,
                  max_tree_nodes: int | None = None, max_spec_factor: float | None = None,
                  max_spec_offset: float | None = None, min_token_prob: float | None = None) -> Proposal:
        """Draft continuation for one request. `num_speculative_tokens=None` takes the cache's default; 0 gives an empty
        proposal. In tree mode the draft is a tree of at most `max_tree_nodes` tokens (default: num_speculative_tokens),
        expanded best-first by path probability, no deeper than the chain limit."""
        k, nodes, f, o, p = self._spec_args(num_speculative_tokens, max_spec_factor, max_spec_offset, min_token_prob,
                                            max_tree_nodes)
        with self._lock:
            state = self._live.get(request_id)
            if state is None:
                state = self._state(request_id)     # raises the right error
            if k == 0:
                return Proposal.empty("suffix")
            return _tree.speculate_request(state, self._global, k, nodes, f, o, p, tree)

    def speculate_batch(self, request_ids: Iterable[Hashable], num_speculative_tokens: int | None = None, *,
                        tree: bool = False, max_tree_nodes: int | None = None, max_spec_factor: float | None = None,
                        max_spec_offset: float | None = None, min_token_prob: float | None = None) -> list[Proposal]:
        """Proposals for many requests in one call, drafted with the GIL released."""
        k, nodes, f, o, p = self._spec_args(num_speculative_tokens, max_spec_factor, max_spec_offset, min_token_prob,
                                            max_tree_nodes)
        with self._lock:
            states = [self._state(r) for r in request_ids]
            if not states:
                return []
            if k == 0:
                return [Proposal.empty("suffix") for _ in states]
            return _tree.speculate(states, self._global, k, nodes, f, o, p, bool(tree))

    # ---------------------------------------------------------------- memory and stats

    def memory_bytes(self) -> int:
        with self._lock:
            return self._global.memory_bytes() + sum(s.memory_bytes() for s in self._states())

    def indexed_tokens(self) -> int:
        with self._lock:
            return self._global.n_tokens + sum(s.tree.n_tokens for s in self._states())

    def bytes_per_token(self) -> float:
        """Memory per indexed token, trees and token storage included."""
        with self._lock:
            n = self.indexed_tokens()
            return self.memory_bytes() / n if n else 0.0

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counters, live_requests=len(self._live), retained_requests=len(self._retained),
                        global_tokens=self._global.n_tokens, global_sequences=self._global.n_sequences,
                        global_nodes=self._global.n_nodes, memory_bytes=self.memory_bytes(),
                        bytes_per_token=self.bytes_per_token())

    # ---------------------------------------------------------------- persistence of the global tree

    def save(self, path: str | os.PathLike) -> None:
        """Write the global tree's sequences atomically (temp file + rename), with a versioned header and a SHA-256."""
        with self._lock:
            seqs = self._global.sequences()
            header = json.dumps(dict(max_depth=self.max_depth, vocab_size=self.vocab_size, n_sequences=len(seqs),
                                     n_tokens=self._global.n_tokens)).encode()
            parts = [_MAGIC, struct.pack("<II", _FORMAT_VERSION, len(header)), header]
            for toks, start in seqs:
                parts.append(struct.pack("<II", start, len(toks)))
                parts.append(toks.astype("<i4").tobytes())
        body = b"".join(parts)
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".suffixcache-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.write(hashlib.sha256(body).digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Replace the global tree with a saved one. Any problem with the file raises SuffixCacheFileError and leaves
        this cache as it was."""
        with open(path, "rb") as f:
            data = f.read()
        seqs = _parse_saved(data, os.fspath(path), self.vocab_size)
        tree = _tree.SuffixTree(self.max_depth)
        for toks, _ in seqs:
            tree.add_sequence(toks)
        if seqs:
            tree.evict(seqs[0][1])     # the oldest sequence may have been partly evicted
        with self._lock:
            self._global = tree

    # ---------------------------------------------------------------- internals

    def _states(self):
        return list(self._live.values()) + list(self._retained.values())

    def _state(self, request_id: Hashable) -> _tree.RequestState:
        state = self._live.get(request_id)
        if state is None:
            if request_id in self._retained:
                raise KeyError(f"request {request_id!r} has finished; start a new request (extends=...) to go on")
            raise KeyError(f"unknown request {request_id!r}")
        return state

    def _evict_global(self, quota: int) -> None:
        """Evict up to `quota` suffixes while over budget. Callers pass a fixed slice (well under a millisecond) plus
        what they just added, so the index is back under budget after every finish_request, and no call pays for
        eviction much beyond what it pays anyway to index its own tokens."""
        over = self._global.n_tokens - self.global_budget_tokens
        if over > 0:
            self._counters["evicted_tokens"] += self._global.evict(min(over, quota))

    def _spec_args(self, num_speculative_tokens, max_spec_factor, max_spec_offset, min_token_prob, max_tree_nodes):
        """(max tokens, max tree nodes, factor, offset, min prob) with the defaults filled in, validated. Checked once
        per distinct set of options: the integer options' types are part of the key, so 1.0 or True never passes for a
        validated 1 (the float options compare by value, as they are used)."""
        key = (num_speculative_tokens, max_spec_factor, max_spec_offset, min_token_prob, max_tree_nodes,
               type(num_speculative_tokens), type(max_tree_nodes))
        last_key, resolved = self._resolved
        if key == last_key:
            return resolved
        d = self.defaults
        k = d["num_speculative_tokens"] if num_speculative_tokens is None else num_speculative_tokens
        f = d["max_spec_factor"] if max_spec_factor is None else max_spec_factor
        o = d["max_spec_offset"] if max_spec_offset is None else max_spec_offset
        p = d["min_token_prob"] if min_token_prob is None else min_token_prob
        self._check_spec_args(k, f, o, p, max_tree_nodes)
        resolved = (k, k if max_tree_nodes is None else max_tree_nodes, f, o, p)
        self._resolved = (key, resolved)     # one assignment: a concurrent reader sees a consistent pair
        return resolved

    @staticmethod
    def _check_spec_args(k, factor, offset, min_prob, max_nodes) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"num_speculative_tokens must be an int, got {type(k).__name__}")
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {factor}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_prob}")
        if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, (int, np.integer))
                                      or max_nodes < 1):
            raise ValueError(f"max_tree_nodes must be a positive int, got {max_nodes!r}")


def _parse_saved(data: bytes, name: str, vocab_size: int | None) -> list[tuple[np.ndarray, int]]:
    def fail(why: str) -> SuffixCacheFileError:
        return SuffixCacheFileError(f"{name}: {why}")

    if len(data) < len(_MAGIC) + 8 + 32:
        raise fail("too short to be a hybridspec suffix cache (truncated?)")
    if data[: len(_MAGIC)] != _MAGIC:
        raise fail("not a hybridspec suffix cache file (bad magic)")
    version, hlen = struct.unpack_from("<II", data, len(_MAGIC))
    if version != _FORMAT_VERSION:
        raise fail(f"format version {version} is not supported (this build reads {_FORMAT_VERSION})")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise fail("checksum mismatch: the file is truncated or corrupt")
    pos = len(_MAGIC) + 8
    try:
        header = json.loads(body[pos: pos + hlen])
        n = int(header["n_sequences"])
    except (ValueError, KeyError, TypeError) as e:
        raise fail(f"unreadable header ({e})") from None
    pos += hlen
    seqs = []
    for i in range(n):
        if pos + 8 > len(body):
            raise fail(f"sequence {i} is cut off")
        start, length = struct.unpack_from("<II", body, pos)
        pos += 8
        if pos + 4 * length > len(body) or start > length:
            raise fail(f"sequence {i} is cut off or inconsistent")
        toks = np.frombuffer(body, dtype="<i4", count=length, offset=pos).astype(np.int32)
        pos += 4 * length
        try:
            toks = as_token_array(toks, vocab_size)
        except ValueError as e:
            raise fail(f"sequence {i}: {e}") from None
        if i > 0 and start != 0:
            raise fail(f"sequence {i}: only the oldest sequence can be partly evicted")
        seqs.append((toks, start))
    if pos != len(body):
        raise fail("trailing bytes after the last sequence")
    return seqs
