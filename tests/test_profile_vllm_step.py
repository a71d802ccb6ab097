"""benchmarks/profile_vllm_step.py's pure-Python parts (timer accounting, decode-step test, summary, table) with a fake
clock: no vLLM needed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from profile_vllm_step import PARTS, STEP, StepProfiler, format_table, is_decode, summarize  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def one_step(decode: bool = True) -> tuple[StepProfiler, FakeClock]:
    """A step of 10 s: 1 s own, EAGLE propose 5 s of which the drafter's forward 3 s, the target 2 s, the plugin 2 s
    (1 s own, 1 s in update nested under it)."""
    clock = FakeClock()
    prof = StepProfiler(clock)
    prof.recording = True

    def drafter():
        clock.advance(3)

    def eagle():
        clock.advance(2)
        timed_drafter()

    def update():
        clock.advance(1)

    def plugin():
        clock.advance(1)
        timed_update()

    def target():
        prof.mark("decode", decode)
        prof.mark("tokens", 3)
        prof.mark("scheduled", 4)
        clock.advance(2)

    timed_drafter = prof.wrap(drafter, "drafter forward")
    timed_update = prof.wrap(update, "plugin update")
    timed_eagle, timed_plugin = prof.wrap(eagle, "EAGLE propose"), prof.wrap(plugin, "plugin propose")
    timed_target = prof.wrap(target, "target forward")

    def step():
        clock.advance(1)
        timed_target()
        timed_eagle()
        timed_plugin()

    prof.wrap(step, STEP)()
    return prof, clock


def test_exclusive_times_add_up_to_the_step():
    prof, _ = one_step()
    (step,) = prof.steps
    assert step["total"] == 10
    assert step["parts"] == {"target forward": 2, "EAGLE propose": 2, "drafter forward": 3, "plugin propose": 1,
                             "plugin update": 1}
    assert step["remainder"] == 1
    assert step["decode"] is True and step["tokens"] == 3


def test_parts_outside_a_step_or_while_not_recording_are_not_timed():
    clock = FakeClock()
    prof = StepProfiler(clock)
    part = prof.wrap(lambda: clock.advance(5), "target forward")
    step = prof.wrap(lambda: part(), STEP)
    prof.recording = True
    assert part() is None and prof.steps == []  # a dummy run: no step open
    prof.recording = False
    step()
    assert prof.steps == []


def test_a_failing_part_still_closes_its_frame():
    clock = FakeClock()
    prof = StepProfiler(clock)
    prof.recording = True

    def boom():
        clock.advance(2)
        raise ValueError

    timed = prof.wrap(boom, "plugin update")

    def step():
        with pytest.raises(ValueError):
            timed()
        clock.advance(1)

    prof.wrap(step, STEP)()
    assert prof.steps[0]["parts"] == {"plugin update": 2} and prof.steps[0]["remainder"] == 1


def test_is_decode():
    assert is_decode({"a": 4, "b": 1}, {"a": [7, 8, 9]}, 0)
    assert not is_decode({"a": 4}, {"a": [7, 8, 9]}, 1)  # a new request (a fully cached prompt runs 1 token too)
    assert not is_decode({"a": 512}, {}, 0)  # a prompt chunk
    assert not is_decode({}, {}, 0)


def test_summary_means_decode_steps_only():
    a, _ = one_step()
    b, _ = one_step()
    prefill, _ = one_step(decode=False)
    steps = a.steps + b.steps + prefill.steps
    steps[1]["total"] += 2  # a slower second step: 12 s, its extra in the remainder
    steps[1]["remainder"] += 2
    s = summarize(steps)
    assert s["steps"] == 2 and s["prefill_steps"] == 1
    assert s["total_ms"] == 11_000
    assert s["ms"]["drafter forward"] == 3_000 and s["ms"]["rejection sampler"] == 0
    assert s["remainder_ms"] == pytest.approx(2_000)  # total minus the parts
    assert s["tokens_per_step"] == 3 and s["scheduled_per_step"] == 4 and s["ms_per_token"] == pytest.approx(11_000 / 3)
    assert set(s["ms"]) == set(PARTS)


def test_summary_of_no_decode_step_is_zero():
    s = summarize([])
    assert s["steps"] == 0 and s["total_ms"] == 0 and s["ms_per_token"] == 0


def test_table_has_a_column_per_method_and_a_row_per_part():
    prof, _ = one_step()
    table = format_table({"hybridspec-suffix": summarize(prof.steps), "hybridspec-hybrid": summarize(prof.steps)})
    lines = table.splitlines()
    assert "hybridspec-suffix" in lines[0] and "hybridspec-hybrid" in lines[0]
    drafter = next(line for line in lines if line.startswith("drafter forward"))
    assert drafter.split()[-2:] == ["3000.00", "3000.00"]
    assert len(lines) == 1 + len(PARTS) + 7
