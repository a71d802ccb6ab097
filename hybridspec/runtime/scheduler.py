"""How concurrent calls share one engine: a lock granted in arrival order, and decode steps that run every call
waiting for one in a single pass of the target (continuous batching).

A call's thread asks for its next step with `StepScheduler.join_step`; whichever thread gets the lock first runs the
step for every call queued then, and the others find their step done. An error in one call's part of a step is
delivered to that call's thread (`CallState.fail`); the other calls go on.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Generic, TypeVar

Call = TypeVar("Call")


class TurnLock:
    """A reentrant lock granted in arrival order: a thread that releases it and asks again queues behind the threads
    already waiting, so concurrent calls advance a step each in turn (a plain lock lets one call run to its end)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[int] = deque()
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self) -> "TurnLock":
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            self._waiting.append(me)
            while self._owner is not None or self._waiting[0] != me:
                self._cond.wait()
            self._waiting.popleft()
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()


class StepScheduler(Generic[Call]):
    """Runs `run_step(calls)` for every call whose thread is waiting for its next decode step. Anything else that
    touches shared state (a call's prefill, its end) runs under `lock` too.

    running(): how many calls are running (begun, not ended). A thread that gets to run a step while some of them have
    not asked for it yet waits up to `gather_s` for them: a thread a moment late (handing its text delta to an HTTP
    response, say) would otherwise miss the step and run the next one alone, a pass of the target for fewer rows."""

    def __init__(self, run_step: Callable[[list[Call]], None], running: Callable[[], int] | None = None,
                 gather_s: float = 0.002) -> None:
        self.lock = TurnLock()
        self._run_step = run_step
        self._running, self._gather_s = running, gather_s
        self._waiting: list[Call] = []
        self._arrived = threading.Condition()  # guards _waiting

    def join_step(self, call: Call) -> None:
        """Return once `call`'s next decode step has run: run by this thread, with every call waiting then, or by
        another thread that got the lock first."""
        with self._arrived:
            self._waiting.append(call)
            self._arrived.notify_all()
        with self.lock:
            with self._arrived:
                if not any(c is call for c in self._waiting):
                    return  # another thread ran this call's step
                if self._running is not None:
                    expected = self._running()
                    self._arrived.wait_for(lambda: len(self._waiting) >= expected, timeout=self._gather_s)
                batch, self._waiting = self._waiting, []
            self._run_step(batch)
