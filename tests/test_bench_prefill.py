"""benchmarks/bench_prefill.py: one tiny real run of its three methods on a real agent prompt (slow: SmolLM2 and
vLLM's worker)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_a_tiny_prefill_run_times_every_method_on_the_same_prompt(tmp_path, capsys):
    import bench_prefill

    out = tmp_path / "prefill.json"
    assert bench_prefill.main(["--trajectories", "1", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (call,) = result["calls"]
    assert call["prompt_tokens"] > 300  # a real agent prompt, plus the run's unique token
    assert all(call[m] > 0 for m in bench_prefill.METHODS)
    everything = result["rows"][0]
    assert everything["prompts"] == "all" and everything["tokens"] == call["prompt_tokens"]
    for method in bench_prefill.METHODS:
        assert everything[method] == pytest.approx(1000 * call[method] / call["prompt_tokens"], rel=0.01)
    from hybridspec.model.attention import _kernels

    assert result["config"]["kernel"] is (_kernels is not None and _kernels.supported())
    assert "ms per prompt token" in capsys.readouterr().out
