"""The decode step's one rule for failures (`each`): a call whose part of a step raises ends with its own error and
leaves the step; the other calls go on; a call that failed in an earlier phase is not worked on again."""
from __future__ import annotations

import weakref

from hybridspec.runtime.call import CallState, SequenceState
from hybridspec.runtime.handle import RequestHandle
from hybridspec.runtime.options import SamplingOptions
from hybridspec.runtime.prefill import PromptChunk
from hybridspec.runtime.scheduler import CallPlan
from hybridspec.runtime.step import CallStep, each
from hybridspec.runtime.text import SequenceText

HANDLE = RequestHandle()


def call(rows: int = 2) -> CallState:
    seqs = [SequenceState(f"r{i}", [1, 2, 3], 3, SequenceText(str)) for i in range(rows)]
    return CallState(seqs, SamplingOptions(), None, None, weakref.ref(HANDLE))


def test_a_failing_call_leaves_the_step_and_the_others_go_on():
    ok, broken, other, failed_before = call(), call(), call(), call()
    failed_before.fail(RuntimeError("earlier phase"))
    seen = []

    def work(step: CallStep):
        seen.append(step.call)
        if step.call is broken:
            raise ValueError("this call's proposer broke")

    steps = [CallStep(CallPlan(c, PromptChunk([]))) for c in (ok, broken, other, failed_before)]
    going = each(steps, work, "update_s")
    assert [s.call for s in going] == [ok, other]
    assert seen == [ok, broken, other]  # a call that failed earlier is not worked on again
    assert isinstance(broken.error, ValueError) and broken.rows == []  # its caller gets it; its rows are gone
    assert broken.done and not ok.done and ok.rows == [0, 1]
    assert ok.error is None and ok.stats.update_s > 0  # the phase's time is counted on the call
    assert str(failed_before.error) == "earlier phase"
