"""benchmarks/bench_mixed.py and the workloads it shares with bench_e2e.py: the interleaving of the three workloads,
HumanEval prompts a recipe never trained on, summaries against the reference; and one tiny real run (slow)."""
from __future__ import annotations

import json

import pytest

from bench_e2e import HUMANEVAL_PROMPT, code_prompts
from bench_mixed import Request, mixed_requests, summarize
from common import REPO, WORKLOADS_DIR

RECIPE = REPO / "speculators" / "recipes" / "peagle-smollm2.yaml"


def test_requests_take_turns_by_workload_and_the_longer_lists_finish_last():
    agent = [Request("agent", f"a{i}", [i]) for i in range(3)]
    chat = [Request("chat", "c0", [])]
    code = [Request("code", f"h{i}", []) for i in range(2)]
    assert [r.name for r in mixed_requests(agent, chat, code)] == ["a0", "c0", "h0", "a1", "h1", "a2"]


def test_code_prompts_are_those_the_recipe_never_trained_on():
    from hybridspec.speculators.train import load_recipe
    from hybridspec.speculators.train.data import load_items

    everything = code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", 1000)
    assert len(everything) == 164 and everything[0].startswith(HUMANEVAL_PROMPT.split("{")[0])
    held = code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", 1000, RECIPE)
    trained = {i.prompt for i in load_items(load_recipe(RECIPE), skip_ungenerated=True)["train"]}
    assert held and not set(held) & trained
    assert len(held) == len(everything) - len(set(everything) & trained) > 100  # the recipe trains on 36 of 164
    assert code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", 5, RECIPE) == held[:5]


def test_summaries_count_tokens_over_whole_call_time_and_identical_outputs():
    runs = [{"name": "a", "tokens": [1, 2, 3], "total_s": 1.0, "steps": 2, "drafter_runs": 1},
            {"name": "b", "tokens": [4], "total_s": 0.5, "steps": 1, "drafter_runs": 0}]
    s = summarize(runs, {"a": [1, 2, 3], "b": [5]})
    assert s["tok_s"] == pytest.approx(4 / 1.5, abs=1e-3) and s["tokens_per_step"] == pytest.approx(4 / 3, abs=1e-3)
    assert (s["identical"], s["requests"], s["drafter_runs"]) == (1, 2, 1)


@pytest.mark.slow
def test_a_tiny_mixed_run_writes_every_workload(tmp_path):
    import bench_mixed

    out = tmp_path / "mixed.json"
    assert bench_mixed.main(["--trajectories", "1", "--calls-per-trajectory", "1", "--chat", "1", "--code", "1",
                             "--max-new-tokens", "6", "--methods", "suffix,suffix+peagle", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["workloads"]) == {"agent", "chat", "code", "mixed"}
    for per_method in result["workloads"].values():
        assert set(per_method) == {"none", "suffix", "suffix+peagle"}
        assert all(s["identical"] == s["requests"] for s in per_method.values())  # outputs equal speculate="none"
    assert result["workloads"]["mixed"]["none"]["requests"] == 3
    assert result["target"] is None  # peagle alone was not run: the hybrid cannot be judged against both halves
