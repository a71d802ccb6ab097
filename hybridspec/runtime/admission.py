"""Admission control: how many calls run at once and how much KV they hold, so that no burst of requests can take
the machine's memory (vLLM bounds its running sequences and KV blocks; llama-server has slots).

A call runs once fewer than `max_num_seqs` calls run and the KV it will hold fits in `kv_cache_memory` beside theirs
(a call alone always runs). Until then it waits, in arrival order: the first waiting call holds back those behind it,
so a long prompt is never starved by short ones. At most `max_waiting` calls wait; one more is refused at once
(`QueueFull`, the server's 429), having held nothing. A call cancelled while it waits leaves the queue and never runs;
one that ends (or is cancelled while running) frees its place and its KV for the next at once.

Defaults (`Limits.default`): the whole process within about half of the machine's memory, or of a container's limit:
the KV budget is that half less what the process holds already (the model, the runtime), the prefix cache's budget
and room for a step's activations.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Hashable

from hybridspec.errors import QueueFull

MEMORY_SHARE = 0.5  # of the machine's (or container's) memory, for the whole process by default
STEP_RESERVE_BYTES = 1 << 30  # a step's activations: logits of every verified token, attention of a prompt chunk
MIN_KV_BUDGET = 256 << 20
MAX_NUM_SEQS = 64
MAX_WAITING = 1024


@dataclass(frozen=True)
class Limits:
    """max_num_seqs: calls running at once; kv_cache_memory: the bytes of KV their caches may hold together;
    max_waiting: calls that may wait for a place (one more is refused with `QueueFull`). The same names as
    `Engine(...)`'s and `hybridspec serve`'s (`--max-num-seqs`, `--kv-cache-memory`, `--max-waiting`)."""

    max_num_seqs: int = MAX_NUM_SEQS
    kv_cache_memory: int = 8 << 30
    max_waiting: int = MAX_WAITING

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.kv_cache_memory < 1 or self.max_waiting < 0:
            raise ValueError(f"max_num_seqs and kv_cache_memory must be >= 1 and max_waiting >= 0, got "
                             f"{self.max_num_seqs}, {self.kv_cache_memory}, {self.max_waiting}")

    @classmethod
    def default(cls, prefix_cache_bytes: int, max_num_seqs: int | None = None, kv_cache_memory: int | None = None,
                max_waiting: int | None = None) -> "Limits":
        """The limits given, the others by default: the KV budget keeps the process within MEMORY_SHARE of the
        memory it may use (`memory_limit_bytes`) beside what it holds now and the prefix cache."""
        if kv_cache_memory is None:
            from hybridspec.model.machine import memory_limit_bytes, resident_bytes

            share = int(MEMORY_SHARE * memory_limit_bytes())
            kv_cache_memory = max(MIN_KV_BUDGET, share - resident_bytes() - prefix_cache_bytes - STEP_RESERVE_BYTES)
        return cls(MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs, kv_cache_memory,
                   MAX_WAITING if max_waiting is None else max_waiting)


class Admission:
    """The line in front of an engine's running calls (see the module docstring). Calls are any hashable objects:
    `enqueue` puts one in line or refuses it (from the caller's thread), and the engine's loop `admit`s the first in
    line once it fits, `drop`s one whose caller gave up before it ran, and has a running one `leave`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._waiting: deque[Hashable] = deque()
        self._enqueued: dict[Hashable, tuple[int, float]] = {}  # waiting calls: their KV as estimated, when enqueued
        self._held: dict[Hashable, int] = {}  # running calls' KV
        self._started: dict[Hashable, float] = {}
        self._call_s = 0.0  # recent calls' time running (a moving average): what a refused client should wait
        self.counters = dict(admitted=0, refused=0, cancelled_waiting=0)

    @property
    def running(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_bytes(self) -> int:
        """The KV the running calls hold."""
        return sum(self._held.values())

    def waiting_calls(self) -> list[Hashable]:
        with self._lock:
            return list(self._waiting)

    def enqueue(self, call: Hashable, kv_bytes: int) -> None:
        """Put `call`, which will hold `kv_bytes` of KV, in line; `QueueFull` if it could neither run now nor wait."""
        with self._lock:
            # calls in line that a free place awaits (the loop has yet to admit them) do not count as waiting
            waiting = len(self._waiting) - max(0, self.limits.max_num_seqs - len(self._held))
            if waiting >= self.limits.max_waiting and (self._waiting or not self._fits(kv_bytes)):
                self.counters["refused"] += 1
                raise QueueFull(f"the server is at its limit: {len(self._held)} calls running, {len(self._waiting)} "
                                f"waiting (at most {self.limits.max_waiting}); retry later", self.retry_after())
            self._waiting.append(call)
            self._enqueued[call] = (kv_bytes, time.perf_counter())

    def admit(self) -> tuple[Hashable, float] | None:
        """The first call in line, if it fits now beside the running ones (it then counts as running), and the
        seconds it waited; None if none may run yet."""
        with self._lock:
            if not self._waiting:
                return None
            call = self._waiting[0]
            kv_bytes, since = self._enqueued[call]
            if not self._fits(kv_bytes):
                return None
            self._waiting.popleft()
            del self._enqueued[call]
            self._held[call] = kv_bytes
            self._started[call] = now = time.perf_counter()
            self.counters["admitted"] += 1
            return call, now - since

    def drop(self, call: Hashable) -> None:
        """A waiting `call` leaves the line without running (its caller gave up)."""
        with self._lock:
            if call in self._enqueued:
                self._waiting.remove(call)
                del self._enqueued[call]
                self.counters["cancelled_waiting"] += 1

    def hold(self, call: Hashable, kv_bytes: int) -> None:
        """What a running call holds, once known (its cache as made: a prefix-cache entry taken over may be larger)."""
        with self._lock:
            if call in self._held:
                self._held[call] = kv_bytes

    def leave(self, call: Hashable) -> None:
        """A running `call` ended: its place and KV go to the next in line (idempotent)."""
        with self._lock:
            if self._held.pop(call, None) is not None:
                ran = time.perf_counter() - self._started.pop(call)
                self._call_s = ran if not self._call_s else 0.8 * self._call_s + 0.2 * ran

    def retry_after(self) -> int:
        """Whole seconds after which a place is likely free: a call's recent time running, shared by the places."""
        queue = len(self._waiting) + 1
        return max(1, math.ceil(self._call_s * queue / self.limits.max_num_seqs))

    def _fits(self, kv_bytes: int) -> bool:
        if not self._held:
            return True
        return len(self._held) < self.limits.max_num_seqs and \
            sum(self._held.values()) + kv_bytes <= self.limits.kv_cache_memory
