"""Automatic prefix caching: the KV of recent requests, reused by later calls whose prompts begin with the same tokens.

Agent frameworks call a model statelessly: every call re-sends the whole conversation. A call whose prompt shares a
prefix with an earlier request's prompt + response runs only the tokens after it, as with vLLM's automatic prefix
caching or SGLang's radix cache (per token here, not per block). An entry is one finished request: its tokens and a
one-row `KVCache` of all but its last token (the last one was never run through the model). Entries are kept least
recently used first under a byte budget; an entry whose tokens a newer one extends gives up its KV (the newer one
holds it). An entry that lost its KV keeps its tokens for a while: a proposer retains its finished requests by id, and
a prompt that extends one of them continues it (`extends=`) instead of being indexed afresh.

Not thread-safe: the engine calls it under its lock.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from hybridspec.model.kv_cache import KVCache

# With prefix caching a call's cache is this much larger than the call needs: an agent's next call re-sends the
# conversation plus a few hundred tokens and continues this cache without growing it (growing copies all its KV into
# fresh memory).
KV_SLACK = 0.25
PREFIX_CACHE_BYTES = 2 << 30  # ~46k tokens of SmolLM2-135M's KV in float32 (46 kB per token)


@dataclass
class _Entry:
    tokens: np.ndarray  # the request's prompt + response
    cache: KVCache | None  # row 0 holds the KV of tokens[:-1]; None once evicted
    owner: Hashable  # the proposer that ran the request (a request id means something to it only)


@dataclass
class PrefixMatch:
    """What the cache holds for a prompt: the KV of its first `length` tokens in row 0 of `cache` (length 0: none),
    and `extends`, a finished request of the same owner whose prompt + response (`extends_length` tokens) this prompt
    begins with (None: none)."""

    length: int = 0
    cache: KVCache | None = None
    extends: Hashable | None = None
    extends_length: int = 0
    request_id: Hashable | None = None  # the entry `cache` belongs to


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """The KV of recent requests under `budget_bytes`, and the tokens of the last `max_requests` (see the module
    docstring). `match` finds the longest cached prefix of a prompt; `take` hands an entry's cache over to a call;
    `store` keeps a finished request."""

    def __init__(self, budget_bytes: int, max_requests: int = 256) -> None:
        if budget_bytes < 0 or max_requests < 1:
            raise ValueError(f"budget_bytes must be >= 0 and max_requests >= 1, got {budget_bytes}, {max_requests}")
        self.budget_bytes = budget_bytes
        self.max_requests = max_requests
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.counters = dict(hits=0, misses=0, hit_tokens=0, evicted_bytes=0)

    def __len__(self) -> int:
        """Entries that hold KV."""
        return sum(e.cache is not None for e in self._entries.values())

    def match(self, prompt: Sequence[int], owner: Hashable = None) -> PrefixMatch:
        """The longest prefix of `prompt` whose KV is cached, never its last token (a step's input); ties go to the
        most recently used entry. `extends`: the most recent of `owner`'s requests that the prompt extends."""
        tokens = np.asarray(prompt, dtype=np.int64)
        best = PrefixMatch()
        for request_id, entry in reversed(self._entries.items()):
            n = common_prefix(entry.tokens, tokens)
            if n == len(entry.tokens) and best.extends is None and entry.owner == owner:
                best.extends, best.extends_length = request_id, n
            if entry.cache is not None:
                usable = entry.cache.usable_prefix(0, min(n, len(tokens) - 1, entry.cache.lengths[0]))
                if usable > best.length:
                    best.length, best.cache, best.request_id = usable, entry.cache, request_id
        if best.length:
            self._entries.move_to_end(best.request_id)
            self.counters["hits"] += 1
            self.counters["hit_tokens"] += best.length
        else:
            self.counters["misses"] += 1
        return best

    def take(self, match: PrefixMatch) -> KVCache:
        """The matched entry's cache, now the caller's (it leaves the pool; `store` brings the request back)."""
        entry = self._entries[match.request_id]
        cache, entry.cache = entry.cache, None
        self.nbytes -= cache.nbytes
        return cache

    def store(self, request_id: Hashable, tokens: Sequence[int], cache: KVCache, owner: Hashable = None) -> None:
        """Keep a finished request: `tokens` its prompt + response, `cache` a one-row cache holding the KV of all but
        the last of them (the caller must not touch it afterwards), `owner` the proposer that ran it."""
        if cache.batch_size != 1 or cache.lengths[0] != len(tokens) - 1:
            raise ValueError(f"store needs a one-row cache of {len(tokens) - 1} tokens, got {cache.batch_size} rows of "
                             f"{cache.lengths}")
        new = np.asarray(tokens, dtype=np.int64)
        for entry in self._entries.values():
            if entry.cache is not None and len(entry.tokens) <= len(new) \
                    and common_prefix(entry.tokens, new) == len(entry.tokens):
                self._drop_kv(entry)  # the new entry holds all of this one's KV
        self._entries.pop(request_id, None)
        self._entries[request_id] = _Entry(new, cache, owner)
        self.nbytes += cache.nbytes
        for entry in self._entries.values():
            if self.nbytes <= self.budget_bytes:
                break
            if entry.cache is not None:
                self.counters["evicted_bytes"] += entry.cache.nbytes
                self._drop_kv(entry)
        while len(self._entries) > self.max_requests:
            self._drop_kv(self._entries.popitem(last=False)[1])

    def _drop_kv(self, entry: _Entry) -> None:
        if entry.cache is not None:
            self.nbytes -= entry.cache.nbytes
            entry.cache = None

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def cache_capacity(need: int, max_len: int, prefix_caching: bool) -> int:
    """The slots of a call's cache that needs `need`: KV_SLACK more under prefix caching, at most `max_len`."""
    return min(need + int(need * KV_SLACK), max_len) if prefix_caching else need


def cache_for_prompts(prefix_cache: PrefixCache | None, new_cache: Callable[[int, int], KVCache],
                      prompts: Sequence[Sequence[int]], need: int, max_len: int, owner: Hashable,
                      feature_tail: int = 0) -> tuple[KVCache, list[Hashable | None]]:
    """The policy of a call's cache: at least `need` slots (with KV_SLACK under prefix caching, at most `max_len`),
    row r holding the KV of the longest cached prefix of prompts[r], and per prompt the finished request of `owner`
    (its proposer) that it extends, or None. A single prompt that continues most of an entry takes that entry's cache
    (no copy unless it must grow). A proposer that reads the target's features needs them at the prompt's last
    `feature_tail` positions (0: it reads none): it gets them by running that much of the prompt, unless it continues
    the request it extends. new_cache(rows, capacity) makes an empty cache."""
    capacity = cache_capacity(need, max_len, prefix_cache is not None)
    if prefix_cache is None:
        return new_cache(len(prompts), capacity), [None] * len(prompts)
    matches = [prefix_cache.match(prompt, owner) for prompt in prompts]
    for prompt, m in zip(prompts, matches):
        if not feature_tail:
            continue
        if m.extends is not None and m.length >= m.extends_length - 1:
            m.length = m.extends_length - 1  # the drafter continues the extended request's state from here
        else:  # a drafter starting afresh reads the target's features at the prompt's tail
            m.length = max(0, min(m.length, len(prompt) - 1 - feature_tail))
        if m.length:
            m.length = m.cache.usable_prefix(0, m.length)
    extends = [m.extends for m in matches]
    m = matches[0]
    if len(prompts) == 1 and m.length and 2 * m.length >= m.cache.lengths[0]:
        cache = prefix_cache.take(m)
        cache.truncate(0, m.length)
        if cache.capacity < need:
            cache.reserve(capacity, exact=True)
        return cache, extends
    cache = new_cache(len(prompts), capacity)
    for row, m in enumerate(matches):
        if m.length:
            cache.copy_prefix(row, m.cache, 0, m.length)
    return cache, extends
