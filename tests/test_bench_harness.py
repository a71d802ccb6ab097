"""benchmarks/harness.py, the harness of bench_agent_calls, bench_serve, bench_mixed and bench_e2e, on stand-ins: the
two replays' order, the summaries (tokens and text, concurrency 1 and C, engine counters), ratios against peers,
targets, the table and the JSON."""
from __future__ import annotations

import json
import threading
import time
from argparse import Namespace
from types import SimpleNamespace

import pytest

from agent_calls import AgentCall
from harness import (IDENTICAL, METHOD, TOK_S, CallRecord, add_level, add_ratio, best, by_method, engine_call,
                     engine_record, interleave, print_table, record, reference_outputs, replay, report, rows, summarize,
                     summarize_runs, target, write)
from hybridspec.runtime.stats import GenerationStats


def calls(trajectories: int, per_trajectory: int) -> list[list[AgentCall]]:
    return [[AgentCall(f"SWE-agent__x/t{t}", i, [{"role": "user", "content": f"t{t} c{i}"}], [1] * (10 + i))
             for i in range(per_trajectory)] for t in range(trajectories)]


def test_a_call_s_workload_is_its_framework_unless_given():
    call = calls(1, 1)[0][0]
    assert call.workload == "SWE-agent"
    assert AgentCall("mt_bench", 3, [], [1, 2], "chat").workload == "chat"
    r = record("m", call, [5, 6, 7], 1.0, 0.25, steps=2)
    assert (r.workload, r.key, r.prompt_tokens, r.new_tokens) == ("SWE-agent", ("SWE-agent__x/t0", 0), 10, 3)
    assert record("m", call, "some text", 1.0, None, new_tokens=4).new_tokens == 4


def test_interleave_runs_every_method_on_a_call_before_the_next_in_a_rotating_order():
    order = []

    def runner(method):
        def run(call):
            order.append((call.index, method))
            return record(method, call, [call.index], 0.1, 0.05)
        return run

    records = interleave({m: runner(m) for m in ("a", "b", "c")}, calls(1, 4)[0])
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b"),
                     (3, "a"), (3, "b"), (3, "c")]
    assert [r.method for r in records] == [m for _, m in order]
    assert list(by_method(records, ["c", "a"])) == ["c", "a", "b"]
    assert interleave({}, calls(1, 2)[0]) == []


def test_replay_keeps_each_trajectory_in_order_with_at_most_c_agents():
    trajectories = calls(trajectories=5, per_trajectory=3)
    lock, live, events = threading.Lock(), [0], []

    def run_call(call: AgentCall) -> CallRecord:
        with lock:
            live[0] += 1
            events.append(("start", call.trajectory, call.index, live[0]))
        time.sleep(0.01)
        with lock:
            live[0] -= 1
        return record("m", call, "x", 0.01, 0.005, new_tokens=3)

    records, wall_s = replay(run_call, trajectories, concurrency=2)
    assert [(r.trajectory, r.index) for r in records] == [(c.trajectory, c.index) for cs in trajectories for c in cs]
    assert max(n for *_, n in events) == 2 and wall_s > 0
    for t in range(5):  # each trajectory's calls start in order
        assert [i for _, traj, i, _ in events if traj.endswith(f"t{t}")] == [0, 1, 2]


def engine_result(tokens, steps, first_token_s, drafter_runs=0):
    stats = GenerationStats(calls=1, new_tokens=len(tokens), steps=steps, first_token_s=first_token_s,
                            drafter_runs=drafter_runs, total_s=1.0)
    return SimpleNamespace(token_ids=tokens, text="".join(map(str, tokens)), finish_reason="length", stats=stats)


def test_summaries_of_tokens_at_concurrency_1_and_c_with_the_engine_s_counters():
    a, b = calls(1, 2)[0]
    none = [engine_record("none", a, engine_result([1, 2, 3], 3, 0.5), 1.0),
            engine_record("none", b, engine_result([4], 1, 0.2), 0.5)]
    suffix = [engine_record("suffix", a, engine_result([1, 2, 3], 2, 0.5, drafter_runs=1), 1.0),
              engine_record("suffix", b, engine_result([5], 1, 0.2), 0.5)]
    reference = reference_outputs(none + suffix, "none")
    s = summarize(suffix, reference)
    assert s["tok_s"] == pytest.approx(4 / 1.5, abs=1e-3) and s["tokens_per_step"] == pytest.approx(4 / 3, abs=1e-3)
    assert (s["identical_calls"], s["compared_calls"], s["calls"], s["new_tokens"]) == (1, 2, 2, 4)
    assert s["ttft_s"] == 0.35 and s["decode_tok_s"] == pytest.approx((4 - 2) / (1.5 - 0.7), abs=1e-3)
    assert s["engine"]["drafter_runs"] == 1 and s["engine"]["new_tokens"] == 4 and s["engine"]["calls"] == 2
    assert "wall_s" not in s and "per_call_tok_s" not in s and "prompt_token_mismatches" not in s
    concurrent = summarize(suffix, reference, concurrency=4, wall_s=0.8)
    assert concurrent["tok_s"] == 5.0 and concurrent["per_call_tok_s"] == pytest.approx(4 / 1.5, abs=1e-3)
    sent = []

    def generate(ids, **options):
        sent.append((ids, options))
        return engine_result([1, 2], 1, 0.1)

    engine = SimpleNamespace(generate=generate)
    text = engine_call(engine, "e", "text", max_new_tokens=2, speculate="suffix")(a)
    assert sent == [(a.prompt_token_ids, {"max_new_tokens": 2, "speculate": "suffix"})]
    assert (text.method, text.output, text.new_tokens, text.steps, text.ttft_s) == ("e", "12", 2, 1, 0.1)
    assert text.total_s > 0 and text.finish_reason == "length"

    tables = summarize_runs({"none": none, "suffix": suffix}, reference)
    assert list(tables) == ["overall", "SWE-agent"] and tables["overall"]["suffix"] == s
    assert set(summarize_runs({"suffix": suffix}, reference, 4, {"suffix": 0.8})) == {"overall"}


def test_ratios_against_named_peers_best_and_targets():
    table = {"x": {"tok_s": 10.0, "identical_calls": 2, "calls": 2}, "y": {"tok_s": 5.0}, "z": {"tok_s": 8.0}}
    add_ratio(table, "vs_y", table["y"])
    assert [s["vs_y"] for s in table.values()] == [2.0, 1.0, 1.6]
    add_ratio(table, "vs_peer", lambda m: {"x": table["z"]}.get(m))
    assert [s["vs_peer"] for s in table.values()] == [1.25, None, None]
    add_ratio(table, "vs_missing", None)
    assert all(s["vs_missing"] is None for s in table.values())
    assert best(table, ["y", "z", "absent"]) == "z" and best(table, ["absent"]) is None
    assert target(table["x"], table["z"], 1.2) == {"ratio": 1.25, "target": 1.2, "pass": True}
    assert target(table["x"], table["z"], 1.2, identical=True, best="z")["identical"]
    assert target(table["x"], None, 1.0) is None


def test_the_table_shows_each_workload_then_overall(capsys):
    tables = {"overall": {"m": {"tok_s": 3.0, "identical_calls": 1, "compared_calls": 2}},
              "chat": {"a-long-method-name-that-widens-the-column": {"tok_s": 1.5, "identical_calls": 0,
                                                                     "compared_calls": 0}}}
    table_rows = rows(tables)
    assert [r["workload"] for r in table_rows] == ["chat", "overall"]
    print_table("title", table_rows, (METHOD, TOK_S, IDENTICAL))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "title" and lines[2].split() == ["method", "tok/s", "identical"]
    assert lines[3].split() == ["a-long-method-name-that-widens-the-column", "1.50", "-"]
    assert lines[4].split() == ["m", "3.00", "1/2"]
    assert rows(tables, methods=lambda m: m == "m") == [{**tables["overall"]["m"], "workload": "overall",
                                                         "method": "m"}]


def test_the_json_lists_the_calls_every_run_and_the_headline(tmp_path):
    a, b = calls(1, 2)[0]
    first = [record("none", a, [1], 1.0, 0.5), record("none", b, [2], 1.0, 0.5), record("x", a, [1], 0.5, 0.1)]
    concurrent = [record("x", a, [1], 0.5, 0.1), record("x", b, [3], 0.5, 0.1)]
    reference = reference_outputs(first, "none")
    workloads = {}
    add_level(workloads, 1, summarize_runs(by_method(first), reference))
    add_level(workloads, 4, summarize_runs({"x": concurrent}, reference, 4, {"x": 0.6}))
    assert set(workloads) == {"overall", "SWE-agent"} and list(workloads["overall"]) == ["concurrency-1",
                                                                                        "concurrency-4"]
    result = report(Namespace(json=tmp_path / "r.json"), time.perf_counter(), workloads=workloads, targets={},
                    reference="none", outputs=reference, records={1: first, 4: concurrent}, extra_key=1)
    assert result["methods"] == workloads["overall"]["concurrency-1"]
    assert result["calls"] == [{"trajectory": a.trajectory, "index": 0, "workload": "SWE-agent", "prompt_tokens": 10},
                               {"trajectory": b.trajectory, "index": 1, "workload": "SWE-agent", "prompt_tokens": 11}]
    assert [(r["method"], r["concurrency"], r["identical"]) for r in result["per_call"]] == [
        ("none", 1, True), ("none", 1, True), ("x", 1, True), ("x", 4, True), ("x", 4, False)]
    assert "output" not in result["per_call"][0] and result["extra_key"] == 1
    assert result["config"] == {"json": str(tmp_path / "r.json")} and result["outputs_compared"] == "tokens"
    write(tmp_path / "r.json", result, "title")
    assert json.loads((tmp_path / "r.json").read_text())["workloads"] == workloads
