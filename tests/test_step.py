"""The decode step's one rule for failures (`each`): a call whose part of a step raises ends with its own error and
leaves the step; the other calls go on; work that returns False sits a call out of the rest of the step."""
from __future__ import annotations

from hybridspec.runtime.call import CallState, SequenceState
from hybridspec.runtime.stats import GenerationStats
from hybridspec.runtime.step import CallStep, each


def call(rows: int = 2) -> CallState:
    seqs = [SequenceState(f"r{i}", [1, 2, 3], 3) for i in range(rows)]
    return CallState(seqs, None, None, None, None, GenerationStats(), rows=list(range(rows)))


def test_a_failing_call_leaves_the_step_and_the_others_go_on():
    ok, broken, waiting, failed_before = call(), call(), call(), call()
    failed_before.fail(RuntimeError("earlier phase"))
    seen = []

    def work(step: CallStep):
        seen.append(step.call)
        if step.call is broken:
            raise ValueError("this call's proposer broke")
        if step.call is waiting:
            return False
        return None

    steps = [CallStep(c) for c in (ok, broken, waiting, failed_before)]
    going = each(steps, work, "update_s")
    assert [s.call for s in going] == [ok]
    assert seen == [ok, broken, waiting]  # a call that failed earlier is not worked on again
    assert isinstance(broken.error, ValueError) and broken.rows == []  # its thread raises it; its rows are gone
    assert waiting.error is None and waiting.rows == [0, 1]  # sat out, not failed
    assert ok.error is None and ok.stats.update_s > 0  # the phase's time is counted on the call
    assert str(failed_before.error) == "earlier phase"
