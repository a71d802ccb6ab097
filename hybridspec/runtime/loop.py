"""The engine's loop: one thread that owns the running calls and runs every step.

    while a call runs or waits:
        drop the calls their callers cancelled     # a waiting one leaves the line, a running one ends now
        admit the calls in line that fit           # `Admission`: places and KV; each begins (`Engine._begin`)
        plan = scheduler.schedule(running, load)   # each call's prompt chunk, draft budgets, feature window
        load = run_step(plan)                      # propose -> grammar -> route -> verify -> commit (`StepRunner`)
        hand each call its new text; end the calls that finished or failed

Callers (`Engine.generate`, `stream`, `Session`, the server) submit a call and hold its `RequestHandle`; they never
lend their thread to a step. The thread starts with the first call and ends when no call runs or waits.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

from hybridspec.model.machine import release_free_memory, release_openmp_threads
from hybridspec.router import StepLoad
from hybridspec.runtime.admission import Admission
from hybridspec.runtime.call import CallState
from hybridspec.runtime.handle import ON_LOOP
from hybridspec.runtime.scheduler import Scheduler, StepPlan


class EngineLoop:
    """Runs an engine's calls on a thread of its own (see the module docstring). begin(call) takes a call's cache and
    starts its requests on the proposer; end(call) ends them (finished or aborted) and counts its statistics."""

    def __init__(self, admission: Admission, scheduler: Scheduler, run_step: Callable[[StepPlan], StepLoad | None],
                 begin: Callable[[CallState], None], end: Callable[[CallState], None]) -> None:
        self.admission, self.scheduler, self.run_step = admission, scheduler, run_step
        self._begin, self._end = begin, end
        self.running: list[CallState] = []  # begun and not ended, oldest first: the loop thread's alone
        self.load: StepLoad | None = None  # the last step's: what a draft token cost in it
        self._lock = threading.Lock()  # guards _thread against a call submitted as the loop goes idle
        self._thread: threading.Thread | None = None
        self._between_steps = threading.RLock()  # held by the loop while it works; `paused` takes it between steps
        self._pausing = 0  # `paused` blocks waiting for the loop or in it: the loop waits before its next step
        self._unpaused = threading.Condition(self._lock)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the loop between two steps for the `with` block: work that must not run beside a step (making a
        proposer, which may time the drafter on this machine), or calls submitted to begin together (none of which
        the block may wait for: the loop waits for the block). The loop's current step is the last before it."""
        with self._lock:
            self._pausing += 1  # a lock is not fair: without this the loop could take it back step after step
        try:
            with self._between_steps:
                yield
        finally:
            with self._lock:
                self._pausing -= 1
                self._unpaused.notify_all()

    def submit(self, call: CallState, kv_bytes: int) -> None:
        """Put `call` in line (`QueueFull`, in the caller's thread, if the line is full) and make sure the loop runs.
        The caller's idle OpenMP team ends here: beside the loop's it slows each step (`release_openmp_threads`)."""
        if not getattr(ON_LOOP, "active", False):
            release_openmp_threads()
        with self._lock:
            self.admission.enqueue(call, kv_bytes)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hybridspec-engine", daemon=True)
                self._thread.start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the loop's thread has ended (no call runs or waits), and its OpenMP team with it: torch work on
        another thread (a peer timed in turns with the engine) then has the CPUs to itself. False if it still runs
        after `timeout` seconds."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _run(self) -> None:
        ON_LOOP.active = True
        while True:
            with self._lock:
                self._unpaused.wait_for(lambda: not self._pausing)
                if not self.running and not self.admission.waiting:
                    self._thread = None
                    break
            try:
                with self._between_steps:
                    self._drop_cancelled()
                    self._admit()
                    if self.running:
                        self._step()
            except Exception as e:  # noqa: BLE001 - a fault of the loop's own: every running call gets it
                for call in list(self.running):
                    call.fail(e)
                    self._finish(call)
        self.load = None
        release_free_memory()

    def _drop_cancelled(self) -> None:
        for call in self.admission.waiting_calls():
            if call.cancelled:
                self.admission.drop(call)
                self._hand_over(call)
        for call in [c for c in self.running if c.cancelled]:
            self._finish(call)

    def _admit(self) -> None:
        while (admitted := self.admission.admit()) is not None:
            call, queued_s = admitted
            call.stats.queue_s = queued_s
            self.running.append(call)
            try:
                self._begin(call)
                self.admission.hold(call, call.cache.nbytes)
            except Exception as e:  # noqa: BLE001 - its prompt or proposer failed: this call alone ends
                call.fail(e)
                self._finish(call)

    def _step(self) -> None:
        plan = self.scheduler.schedule(self.running, self.load)
        self.load = self.run_step(plan)
        for part in plan.calls:
            call = part.call
            handle = call.handle
            if handle is not None and call.streamed and not call.done:
                for delta in call.deltas():
                    handle.push(delta)
        for call in [c for c in self.running if c.done]:
            self._finish(call)

    def _finish(self, call: CallState) -> None:
        """End a running call: its requests end on the proposer, its place and KV go to the next in line, and its
        caller gets its results (or its error)."""
        self.running.remove(call)
        try:
            self._end(call)
        except Exception as e:  # noqa: BLE001 - the proposer failed to end it: the caller gets the error
            call.error = call.error or e
        finally:
            self.admission.leave(call)
        self._hand_over(call)

    def _hand_over(self, call: CallState) -> None:
        handle = call.handle
        if handle is None:
            return
        if call.error is not None:
            handle.end(None, call.error)
        elif handle.cancelled or any(s.finish_reason is None for s in call.seqs):
            handle.end(None)
        else:
            if call.streamed:
                for delta in call.deltas(finished=True):
                    handle.push(delta)
            handle.end(call.results())
