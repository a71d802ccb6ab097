"""`RequestHandle`: a caller's hold on one call the engine's loop runs. The loop hands it each step's new text (and,
with tools, tool-call deltas) and, at the end, the results or the error; the caller iterates the text, waits for
the results, or cancels, from any thread or from an asyncio task. The caller never lends its thread to a step."""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from hybridspec.grammar.tool_calls import Event
from hybridspec.runtime.stats import GenerationResult, TokenLogprob

ON_LOOP = threading.local()  # `active` on an engine's loop thread, which must never wait for its own calls


@dataclass
class Delta:
    """What one step added to one of a call's sequences (`index`): its text, with tools the content and tool-call
    events parsed from that text, and with `logprobs` the log-probabilities of the tokens it committed."""

    index: int
    text: str
    events: list[Event] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class RequestHandle:
    """One call, as its caller holds it. Iterating yields its text deltas as tokens are committed (a single prompt);
    `wait()` returns its results; `result` is the first once it has ended (None if it was cancelled); `close()` ends
    it from any thread and returns once it has (`cancel()` without waiting): a waiting call leaves the line and never
    runs, a running one leaves the batch before the next step, its requests aborted and its place and KV freed. An
    error of the call is raised to its caller, by the iteration or `wait()`. A handle its caller drops (garbage
    collected) cancels its call too."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._outputs: deque[Delta] = deque()
        self._ended = False
        self._notify: Callable[[], None] | None = None  # an asyncio consumer's wake-up
        self.cancelled = False
        self.results: list[GenerationResult] | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------------------------------- the loop's side

    def push(self, delta: Delta) -> None:
        """What a step added to one of the call's sequences."""
        with self._cond:
            self._outputs.append(delta)
            self._cond.notify_all()
        self._poke()

    def end(self, results: list[GenerationResult] | None, error: BaseException | None = None) -> None:
        """The call ended: its results (None: cancelled, or failed with `error`)."""
        with self._cond:
            self.results, self.error, self._ended = results, error, True
            self._cond.notify_all()
        self._poke()

    def _poke(self) -> None:
        notify = self._notify
        if notify is not None:
            notify()

    # ------------------------------------------------------------------------------------------- the caller's side

    @property
    def result(self) -> GenerationResult | None:
        return self.results[0] if self.results else None

    @property
    def ended(self) -> bool:
        return self._ended

    def cancel(self) -> None:
        """End the call before the loop's next step, without waiting for that (an asyncio caller's way)."""
        if not self._ended:
            self.cancelled = True  # the loop reads it before its next step

    def close(self) -> None:
        """End the call and wait until it has ended: its requests aborted, its place and KV freed (on the loop's own
        thread, as from inside a step, it does not wait)."""
        self.cancel()
        if not getattr(ON_LOOP, "active", False):
            with self._cond:
                self._cond.wait_for(lambda: self._ended)

    def wait(self, timeout: float | None = None) -> list[GenerationResult] | None:
        """Block until the call ends; its results (None if cancelled). Raises the call's error; TimeoutError if it
        has not ended within `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ended, timeout):
                raise TimeoutError(f"the call has not ended within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.results

    def __iter__(self) -> "RequestHandle":
        return self

    def __next__(self) -> str:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._outputs or self._ended)
                item = self._outputs.popleft() if self._outputs else None
            if item is None:
                if self.error is not None:
                    raise self.error
                raise StopIteration
            if item.text and item.index == 0:
                return item.text

    async def outputs(self) -> AsyncIterator[Delta]:
        """Every `Delta` of the call as it comes, awaited on the running event loop (never blocking it)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        self._notify = lambda: loop.call_soon_threadsafe(ready.set)
        try:
            while True:
                with self._cond:
                    item = self._outputs.popleft() if self._outputs else None
                    ended = self._ended
                if item is not None:
                    yield item
                elif ended:
                    break
                else:
                    await ready.wait()
                    ready.clear()
        finally:
            self._notify = None
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        state = "ended" if self._ended else "cancelled" if self.cancelled else "running"
        return f"<RequestHandle {state}>"
