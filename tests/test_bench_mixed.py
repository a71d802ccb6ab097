"""benchmarks/bench_mixed.py and the workloads it shares with bench_e2e.py: the interleaving of the three workloads,
HumanEval prompts a recipe never trained on; and one tiny real run of each (slow)."""
from __future__ import annotations

import json

import pytest

from agent_calls import AgentCall
from bench_e2e import HUMANEVAL_PROMPT, code_prompts
from bench_mixed import mixed_calls
from common import REPO, WORKLOADS_DIR

RECIPE = REPO / "speculators" / "recipes" / "peagle-smollm2.yaml"


def test_requests_take_turns_by_workload_and_the_longer_lists_finish_last():
    agent = [AgentCall(f"a{i}", 0, [], [i], "agent") for i in range(3)]
    chat = [AgentCall("c0", 0, [], [], "chat")]
    code = [AgentCall(f"h{i}", 0, [], [], "code") for i in range(2)]
    assert [c.trajectory for c in mixed_calls(agent, chat, code)] == ["a0", "c0", "h0", "a1", "h1", "a2"]


def test_code_prompts_are_those_the_recipe_never_trained_on():
    from hybridspec.speculators.train import load_recipe
    from hybridspec.speculators.train.text import load_items

    everything = code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", 1000)
    assert len(everything) == 164 and everything[0].startswith(HUMANEVAL_PROMPT.split("{")[0])
    held = code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", 1000, RECIPE)
    trained = {i.prompt for i in load_items(load_recipe(RECIPE), skip_ungenerated=True)["train"]}
    assert held and not set(held) & trained
    assert len(held) == len(everything) - len(set(everything) & trained) > 100  # the recipe trains on 36 of 164
    assert code_prompts(WORKLOADS_DIR / "HumanEval.jsonl.gz", 5, RECIPE) == held[:5]


@pytest.mark.slow
def test_a_tiny_mixed_run_writes_every_workload(tmp_path):
    import bench_mixed

    out = tmp_path / "mixed.json"
    assert bench_mixed.main(["--trajectories", "1", "--calls-per-trajectory", "1", "--chat", "1", "--code", "1",
                             "--max-new-tokens", "6", "--methods", "suffix,suffix+peagle", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["workloads"]) == {"agent", "chat", "code", "overall"}
    for levels in result["workloads"].values():
        per_method = levels["concurrency-1"]
        assert set(per_method) == {"none", "suffix", "suffix+peagle"}
        assert all(s["identical_calls"] == s["calls"] for s in per_method.values())  # outputs equal speculate="none"
        assert per_method["none"]["vs_none"] == 1.0
    assert result["methods"]["none"]["calls"] == 3
    assert [c["workload"] for c in result["calls"]] == ["agent", "chat", "code"]
    assert result["targets"] == {}  # peagle alone was not run: the hybrid cannot be judged against both halves
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_a_tiny_e2e_run_compares_every_workload_with_plain_greedy(tmp_path):
    import bench_e2e
    from common import TRACES_DIR

    traces = tmp_path / "traces"  # AutoCodeRover's sessions alone: their prompts are short (~0.5k tokens)
    traces.mkdir()
    folder = next(TRACES_DIR.glob("AutoCodeRover__*"))
    (traces / folder.name).symlink_to(folder)
    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--traces", str(traces), "--workloads", "agent,chat,code",
                           "--agent-sessions-per-framework", "1", "--agent-turns",
                           "2", "--agent-max-new-tokens", "6", "--chat-questions", "1", "--chat-max-new-tokens", "6",
                           "--code-prompts", "1", "--speculate", "suffix", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["workloads"]) == {"agent", "chat", "code", "overall"}
    for levels in result["workloads"].values():
        suffix = levels["concurrency-1"]["suffix"]
        assert suffix["identical_calls"] == suffix["calls"] > 0 and suffix["vs_none"] > 0
        assert "acceptance" in suffix["engine"] and "decode_vs_none" in suffix
    assert set(result["targets"]) == {"agent/suffix", "chat/suffix"}
    assert [(s["session"].split("__")[0], s["turns"]) for s in result["sessions"]] == [("AutoCodeRover", 2)]
