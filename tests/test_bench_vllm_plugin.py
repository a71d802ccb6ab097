"""benchmarks/bench_vllm_plugin.py's replays in turns: with every method's vLLM loaded at once and the calls dealt into
rounds, a host that slows down while the benchmark runs falls on every method alike (fake workers, no vLLM)."""
from __future__ import annotations

import statistics

import pytest

from bench_vllm_plugin import in_call_order, replay_methods, round_ratios, summarize

# the fake methods' true speeds, tokens per unit of host time
SPEED = {"none": 1.0, "hybridspec-suffix": 2.0, "hybridspec-hybrid": 2.2}


class Clock:
    """A host that gets slower with every replay it serves (a busy neighbour arriving)."""

    def __init__(self) -> None:
        self.replays = 0

    def slowdown(self) -> float:
        self.replays += 1
        return 1.0 + 0.05 * self.replays


class FakeWorker:
    def __init__(self, name: str, clock: Clock):
        self.name, self.clock, self.closed = name, clock, False
        self.ready = {"load_s": 0.1}

    def replay(self, trajectories: list[list[list[int]]], max_tokens: int, concurrency: int) -> dict:
        # every method gives the same tokens (the prompt's first token repeated), at its own speed
        calls = [[{"tokens": [prompt[0]] * max_tokens, "steps": max_tokens} for prompt in trajectory]
                 for trajectory in trajectories]
        tokens = sum(len(c["tokens"]) for t in calls for c in t)
        return {"calls": calls, "wall_s": tokens / SPEED[self.name] * self.clock.slowdown()}

    def close(self) -> None:
        self.closed = True


def workloads() -> dict[str, list[list[list[int]]]]:
    return {"agent": [[[100 + t], [200 + t]] for t in range(6)], "chat": [[[300 + q]] for q in range(6)]}


def run(rounds: int):
    clock, started = Clock(), []

    def start(name: str, conc: int) -> FakeWorker:
        open_before.append(sum(not w.closed for w in started))
        started.append(FakeWorker(name, clock))
        return started[-1]

    open_before: list[int] = []
    results, _ = replay_methods(list(SPEED), [1], rounds, workloads(), 8, start)
    return results, started, open_before


def test_in_turns_the_ratio_is_the_methods_own_on_a_host_that_slows_down():
    results, _, _ = run(rounds=1)
    one_at_a_time = summarize(results["hybridspec-hybrid"]["agent"][1] + results["hybridspec-hybrid"]["chat"][1], None)
    suffix = summarize(results["hybridspec-suffix"]["agent"][1] + results["hybridspec-suffix"]["chat"][1], None)
    # one method after another: the hybrid ran later, on a slower host, and looks slower than it is
    assert one_at_a_time["tok_s"] / suffix["tok_s"] < 1.0
    results, workers, _ = run(rounds=6)
    ratios = round_ratios(results["hybridspec-hybrid"], results["hybridspec-suffix"], 1)
    assert len(ratios) == 6
    assert statistics.median(ratios) == pytest.approx(SPEED["hybridspec-hybrid"] / SPEED["hybridspec-suffix"],
                                                      rel=0.03)
    assert [w.name for w in workers] == list(SPEED) and all(w.closed for w in workers)


def test_the_rounds_together_are_every_call_once_in_call_order():
    results, _, _ = run(rounds=4)
    for name in SPEED:
        for workload, trajectories in workloads().items():
            rounds = results[name][workload][1]
            assert len(rounds) == 4
            whole = in_call_order(rounds)
            assert [[c["tokens"][0] for c in t] for t in whole["calls"]] == [[p[0] for p in t] for t in trajectories]
            assert whole["wall_s"] == pytest.approx(sum(r["wall_s"] for r in rounds))
    # each method's replays are judged against `none`'s of the same round: all identical here
    assert summarize(results["hybridspec-hybrid"]["agent"][1], results["none"]["agent"][1])["identical_calls"] == 12


def test_one_vllm_at_a_time_without_rounds_all_at_once_with_them():
    _, workers, open_before = run(rounds=1)
    assert [w.name for w in workers] == list(SPEED) and all(w.closed for w in workers)
    assert open_before == [0, 0, 0]  # memory for one vLLM only
    _, workers, open_before = run(rounds=3)
    assert open_before == [0, 1, 2] and all(w.closed for w in workers)
