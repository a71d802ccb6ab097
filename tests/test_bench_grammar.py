"""benchmarks/bench_grammar.py: the grammar's cost from the per-token decode times of free and constrained decoding
(on all calls, and on those of identical tokens), and a small real run (slow): every grammar method writes the
reference's tokens, the JSON has the targets and the cost."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import bench_grammar
from harness import CallRecord


def rec(method: str, index: int, output: list[int], decode_s: float) -> CallRecord:
    return CallRecord(method, "tools", "t", index, 10, len(output), output, decode_s + 1.0, 1.0,
                      stats=SimpleNamespace(decode_s=decode_s))


def test_the_constrained_cost_is_decode_time_per_token_over_free_decodings():
    runs = {"free-none": [rec("free-none", 0, [1, 2], 1.0), rec("free-none", 1, [5, 6, 7, 8], 2.0)],
            "grammar-none": [rec("grammar-none", 0, [1, 2], 1.1), rec("grammar-none", 1, [3, 4], 1.0)]}
    cost = bench_grammar.constrained_cost(runs)
    assert cost == {"constrained_cost": round((2.1 / 4) / (3.0 / 6), 3), "constrained_cost_identical": 1.1,
                    "same_tokens_calls": 1}
    assert bench_grammar.constrained_cost({"grammar-none": runs["grammar-none"]})["constrained_cost"] is None


@pytest.mark.slow
def test_a_small_run(tmp_path):
    out = tmp_path / "grammar.json"
    assert bench_grammar.main(["--smoke", "--methods", "free-none,grammar-none,grammar-suffix",
                               "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    table = result["methods"]
    assert set(table) == {"free-none", "grammar-none", "grammar-suffix"}
    assert table["grammar-suffix"]["identical_calls"] == table["grammar-suffix"]["calls"] == 3
    assert table["grammar-suffix"]["engine"]["by_source"]["grammar"]["accepted_tokens"] > 0
    assert result["constrained_cost"] > 0 and "grammar_suffix_vs_none@1" in result["targets"]
