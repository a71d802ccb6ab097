"""Smoke test of benchmarks/bench_suffix.py (--quick, n-gram only) and of its workloads and target arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import bench_suffix as bench
from common import REPO

SCRIPT = REPO / "benchmarks" / "bench_suffix.py"
METRICS = {"us_per_speculate", "us_per_append_token", "tokens_per_step", "bytes_per_token", "prompt_index_ms_per_1k"}


def test_quick_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--repeat", "1", "--proposers", "ngram",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "targets (against the peer, same run)" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"workloads", "settings", "machine"}
    assert set(data["workloads"]) == {"agent", "random"}
    for per in data["workloads"].values():
        assert set(per) == {"ngram"}
        assert set(per["ngram"]) == METRICS
        assert all(isinstance(v, float) and v >= 0 for v in per["ngram"].values())
    # the agent workload re-emits code that is in the prompt; random tokens leave nothing to copy
    assert data["workloads"]["agent"]["ngram"]["tokens_per_step"] > 1.5
    assert data["workloads"]["random"]["ngram"]["tokens_per_step"] == 1.0
    s = data["settings"]
    assert (s["max_depth"], s["num_speculative_tokens"], s["proposers"]) == (64, 16, ["ngram"])
    assert {"cpu", "cores", "python", "date"} <= set(data["machine"])


def test_workloads_are_deterministic_and_agent_sessions_extend_their_previous_turn():
    a, b = bench.agent_workload(3, True), bench.agent_workload(3, True)
    assert [r.request_id for r in a] == [r.request_id for r in b]
    assert all(np.array_equal(x.prompt, y.prompt) and np.array_equal(x.response, y.response) for x, y in zip(a, b))
    by_id = {r.request_id: r for r in a}
    for r in a:
        if r.extends is not None:
            prev = by_id[r.extends]
            history = np.concatenate([prev.prompt, prev.response])
            assert np.array_equal(r.prompt[: len(history)], history)
    assert any(r.extends is None for r in a) and any(r.extends is not None for r in a)


def test_targets_compare_ratios_in_the_same_run():
    def m(spec, append, tps, bpt):
        return dict(us_per_speculate=spec, us_per_append_token=append, tokens_per_step=tps, bytes_per_token=bpt,
                    prompt_index_ms_per_1k=1.0)

    results = {"agent": {"hybridspec": m(4.0, 1.0, 3.0, 40.0), "arctic-suffix": m(10.0, 2.0, 2.5, 100.0),
                         "ngram": m(2.0, 0.5, 3.5, 5.0)}}
    verdicts = {what: verdict for what, _, verdict in bench.target_rows(results)}
    assert verdicts["agent: speculate us ours/arctic-suffix <= 0.5"] == "PASS"  # 0.4
    assert verdicts["agent: tokens/step ours/arctic-suffix >= 1"] == "PASS"
    assert verdicts["agent: tokens/step ours/ngram >= 1"] == "FAIL"  # 3.0 < 3.5
    assert verdicts["agent: append us/token ours/arctic-suffix <= 1"] == "PASS"
    assert verdicts["agent: ours bytes/token <= 50"] == "PASS"
    del results["agent"]["arctic-suffix"]
    verdicts = {what: verdict for what, _, verdict in bench.target_rows(results)}
    assert verdicts["agent: speculate us ours/arctic-suffix <= 0.5"] == "n/a"
