"""benchmarks/bench_burst.py: its order and summary on stand-ins, and one small real burst on `hybridspec serve`
(slow)."""
from __future__ import annotations

import json

import pytest

import bench_burst
from agent_calls import AgentCall
from harness import record


def call(t: int, i: int) -> AgentCall:
    return AgentCall(f"SWE-agent__x/t{t}", i, [{"role": "user", "content": f"t{t} c{i}"}], [1] * (10 + i))


def test_the_burst_order_is_a_seeded_shuffle():
    calls = [call(t, i) for t in range(4) for i in range(4)]
    order = bench_burst.burst_order(calls, seed=0)
    assert sorted(order, key=lambda c: (c.trajectory, c.index)) == calls and order != calls
    assert bench_burst.burst_order(calls, seed=0) == order and bench_burst.burst_order(calls, seed=1) != order


def test_the_summary_counts_what_was_lost_refused_and_identical():
    done = [{"status": "ok", "record": record("burst", call(0, i), f"text {i}", 2.0, 0.5 + i, new_tokens=4)}
            for i in range(3)]
    results = done + [{"status": "refused", "error": "429"}, {"status": "failed", "error": "APIConnectionError"}]
    alone = {0: "text 0", 1: "text 1", 2: "other"}
    s = bench_burst.summary(results, alone, wall_s=4.0, baseline=1 << 30, peak=3 << 30, budget=2 << 30,
                            server={"queue_s": 0.5}, gauges={"hybridspec:num_requests_running": 3.0})
    assert (s["requests"], s["completed"], s["refused"], s["failed"]) == (5, 3, 1, 1)
    assert s["errors"] == ["APIConnectionError"] and (s["identical"], s["compared"]) == (2, 3)
    assert s["tok_s"] == 3.0 and s["ttft_median_s"] == 1.5 and s["ttft_p90_s"] == 1.5
    assert not s["within_budget"] and s["peak_rss_gib"] == 3.0 and s["peaks"] == {"num_requests_running": 3.0}


@pytest.mark.slow
def test_a_small_burst_on_the_server(tmp_path):
    out = tmp_path / "burst.json"
    code = bench_burst.main(["--trajectories", "2", "--calls-per-trajectory", "2", "--max-tokens", "8",
                             "--max-num-seqs", "2", "--kv-cache-memory", "400M", "--threads", "1",
                             "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    s = json.loads(out.read_text())
    assert code == 0 and (s["requests"], s["completed"], s["failed"]) == (4, 4, 0)
    assert s["identical"] == s["compared"] == 4 and s["within_budget"]
    assert s["peaks"]["num_requests_running"] <= 2 and s["peaks"]["kv_cache_usage_perc"] <= 1.0
