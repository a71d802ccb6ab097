"""benchmarks/agent_calls.py (the agent-call loader the benchmarks share) and benchmarks/bench_agent_calls.py, end
to end.

The loader is checked on a small synthetic traces folder (fast: a stand-in tokenizer) and on the real traces with
SmolLM2's tokenizer (its token ids are `Engine.encode(messages)`); the benchmark runs on AutoCodeRover's short first
calls with a few new tokens, without vLLM and (marked `vllm`) with it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_calls import AgentCall, load_agent_calls
from common import TRACES_DIR, VLLM_PYTHON

needs_traces = pytest.mark.skipif(not TRACES_DIR.is_dir(), reason=f"agent traces not at {TRACES_DIR}")
SUMMARY_KEYS = {"tok_s", "ttft_s", "tokens_per_step", "identical_calls", "compared_calls", "calls", "vs_transformers"}


class CharTokenizer:
    """Chat template: role and content, one id per character; the generation prompt adds one id."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, return_dict=False):
        assert tokenize and add_generation_prompt and not return_dict
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return [ord(c) for c in text] + [0]


def write_framework(root: Path, folder: str, sessions: dict[str, list[int]]) -> None:
    """Generic-JSONL trajectories: per session, calls whose last user message has the given lengths."""
    (root / folder).mkdir(parents=True)
    for sid, lengths in sessions.items():
        lines = [json.dumps({"session_id": sid, "messages": [{"role": "system", "content": "s"},
                                                             {"role": "user", "content": "x" * n}],
                             "response": f"r{i}"}) for i, n in enumerate(lengths)]
        (root / folder / f"{sid}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture()
def synthetic_traces(tmp_path: Path) -> Path:
    write_framework(tmp_path, "AutoCodeRover__m", {"acr-a": [10, 20, 30], "acr-b": [5, 6, 7]})
    write_framework(tmp_path, "SWE-agent__m", {"swe-a": [10, 500, 20, 30], "swe-b": [1, 2, 3]})
    write_framework(tmp_path, "mini-swe-agent__m", {"mini-a": [400, 400, 400], "mini-b": [3, 4, 5, 6]})
    return tmp_path


def test_calls_are_dealt_round_robin_over_the_frameworks_in_call_order(synthetic_traces):
    tokenizer = CharTokenizer()
    trajectories = load_agent_calls(tokenizer, trajectories=4, calls_per_trajectory=3, max_prompt_tokens=100,
                                    traces_dir=synthetic_traces)
    names = [calls[0].trajectory for calls in trajectories]
    # mini-a has no call that fits: passed over for mini-b; swe-a's second call is too long: skipped
    assert names == ["SWE-agent__m/swe-a", "mini-swe-agent__m/mini-b", "AutoCodeRover__m/acr-a", "SWE-agent__m/swe-b"]
    assert [c.index for c in trajectories[0]] == [0, 2, 3]
    assert [[c.index for c in calls] for calls in trajectories[1:]] == [[0, 1, 2]] * 3
    assert [c.framework for c in trajectories[0]] == ["SWE-agent"] * 3
    for calls in trajectories:
        assert len({c.trajectory for c in calls}) == 1
        for call in calls:
            assert isinstance(call, AgentCall)
            assert set(call.messages[0]) == {"role", "content"}
            assert call.prompt_token_ids == tokenizer.apply_chat_template(call.messages, tokenize=True,
                                                                          add_generation_prompt=True)
            assert len(call.prompt_token_ids) <= 100


def test_too_few_calls_that_fit_is_an_error(synthetic_traces):
    with pytest.raises(ValueError, match="only 0 trajectories"):
        load_agent_calls(CharTokenizer(), trajectories=1, calls_per_trajectory=3, max_prompt_tokens=5,
                         traces_dir=synthetic_traces)


@needs_traces
@pytest.mark.slow
def test_real_calls_are_what_the_engine_encodes():
    from hybridspec import Engine

    engine = Engine.from_pretrained("smollm2")
    trajectories = load_agent_calls(engine.tokenizer, trajectories=3, calls_per_trajectory=3)
    assert [calls[0].framework for calls in trajectories] == ["SWE-agent", "mini-swe-agent", "AutoCodeRover"]
    for calls in trajectories:
        assert [c.index for c in calls] == [0, 1, 2]  # these trajectories' first calls all fit
        for call in calls:
            assert len(call.prompt_token_ids) <= 8192 - 128
            assert call.prompt_token_ids == engine.encode(call.messages)
    # the first SWE-agent trajectory's calls grow past 2.4k tokens after its first: it is passed over
    tight = load_agent_calls(engine.tokenizer, trajectories=1, calls_per_trajectory=2, max_prompt_tokens=2400)
    assert tight[0][0].trajectory != trajectories[0][0].trajectory
    assert all(len(c.prompt_token_ids) <= 2400 for c in tight[0])


# ------------------------------------------------------------------------------------------ the benchmark end to end


@pytest.fixture()
def acr_traces(tmp_path: Path) -> Path:
    """Only AutoCodeRover's trajectories, whose first calls are short (~0.5k tokens)."""
    folder = next(TRACES_DIR.glob("AutoCodeRover__*"))
    (tmp_path / folder.name).symlink_to(folder)
    return tmp_path


def run_bench(tmp_path: Path, traces: Path, *args: str) -> dict:
    from bench_agent_calls import main

    out = tmp_path / "out" / "bench.json"
    assert main(["--traces", str(traces), "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def check_summaries(summaries: dict, methods: list[str], calls: int) -> None:
    assert set(summaries) == set(methods)
    for method, summary in summaries.items():
        assert SUMMARY_KEYS <= set(summary), method
        assert summary["calls"] == calls and summary["tok_s"] > 0 and summary["ttft_s"] > 0
        assert 0 <= summary["identical_calls"] <= calls


@needs_traces
@pytest.mark.slow
def test_bench_without_vllm(tmp_path, acr_traces):
    methods = ["transformers", "transformers-lookup", "none", "suffix"]
    result = run_bench(tmp_path, acr_traces, "--no-vllm", "--methods", ",".join(methods), "--trajectories", "2",
                       "--calls-per-trajectory", "1", "--max-new-tokens", "8", "--concurrency", "1,2",
                       "--concurrent-methods", "suffix")
    check_summaries(result["methods"], methods, calls=2)
    # greedy decoding of the same model in fp32: our engine's outputs are transformers'
    assert result["methods"]["none"]["identical_calls"] == 2
    assert result["methods"]["transformers"]["identical_calls"] == 2
    assert result["methods"]["transformers"]["tokens_per_step"] == 1.0
    assert result["methods"] == result["workloads"]["overall"]["concurrency-1"]
    assert result["methods"]["none"]["engine"]["new_tokens"] == result["methods"]["none"]["new_tokens"]
    assert result["workloads"]["AutoCodeRover"]["concurrency-1"]["suffix"]["calls"] == 2
    assert set(result["workloads"]["AutoCodeRover"]) == {"concurrency-1"}  # per workload at concurrency 1 only
    concurrent = result["workloads"]["overall"]["concurrency-2"]
    assert set(concurrent) == {"suffix"} and concurrent["suffix"]["calls"] == 2
    assert concurrent["suffix"]["identical_calls"] == result["methods"]["suffix"]["identical_calls"]
    assert concurrent["suffix"]["vs_transformers"] is not None  # against transformers at concurrency 1
    assert set(result["targets"]) == {"suffix_vs_transformers"}
    assert result["reference"] == "transformers" and result["outputs_compared"] == "tokens"
    assert [(c["workload"], c["prompt_tokens"] > 0) for c in result["calls"]] == [("AutoCodeRover", True)] * 2
    assert len(result["per_call"]) == 4 * 2 + 2 and all(r["identical"] is not None for r in result["per_call"])
    assert (tmp_path / "out" / "bench.png").is_file()


@needs_traces
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no {VLLM_PYTHON} (scripts/setup_vllm.sh makes it)")
def test_bench_with_vllm(tmp_path, acr_traces):
    methods = ["transformers", "none", "vllm-none"]
    result = run_bench(tmp_path, acr_traces, "--methods", ",".join(methods), "--trajectories", "1",
                       "--calls-per-trajectory", "1", "--max-new-tokens", "8", "--concurrency", "1")
    assert result["not_run"] == {}
    check_summaries(result["methods"], methods, calls=1)
    assert result["methods"]["vllm-none"]["tokens_per_step"] == 1.0
    assert result["methods"]["none"]["identical_calls"] == 1
    assert set(result["targets"]) == set()  # no `suffix` in this run: neither target applies


# ----------------------------------------------------------------------------------- the vLLM worker's replay loop


class FakeRequestOutput:
    def __init__(self, request_id: str, tokens: list[int], finished: bool):
        from types import SimpleNamespace

        self.request_id, self.finished = request_id, finished
        self.outputs = [SimpleNamespace(token_ids=tokens, finish_reason="length" if finished else None)]


class FakeEngine:
    """vLLM's LLMEngine as the worker uses it: every step gives each live request two tokens (the first step one, as
    a prefill), up to max_tokens; records how many requests were live at each step."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[list[int], list[int], int]] = {}
        self.live_per_step: list[int] = []
        self.added: list[list[int]] = []

    def add_request(self, request_id, prompt, params):
        self.live[request_id] = (prompt["prompt_token_ids"], [], params.max_tokens)
        self.added.append(prompt["prompt_token_ids"])
        return request_id

    def step(self):
        self.live_per_step.append(len(self.live))
        outputs = []
        for rid, (prompt, tokens, max_tokens) in list(self.live.items()):
            tokens.extend([prompt[0]] * min(1 if not tokens else 2, max_tokens - len(tokens)))
            finished = len(tokens) >= max_tokens
            outputs.append(FakeRequestOutput(rid, list(tokens), finished))
            if finished:
                del self.live[rid]
        return outputs


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_the_vllm_worker_replays_each_trajectory_in_order_with_c_agents_at_once(concurrency):
    from types import SimpleNamespace

    from vllm_agent_calls_worker import replay

    trajectories = [[[10], [11], [12]], [[20], [21]], [[30]]]
    engine = FakeEngine()
    result = replay(engine, SimpleNamespace(max_tokens=5), trajectories, concurrency)
    calls = result["calls"]
    assert [[c["tokens"] for c in t] for t in calls] == [[[p[0]] * 5 for p in t] for t in trajectories]
    assert all(c["steps"] == 3 and 0 <= c["ttft_s"] <= c["total_s"] for t in calls for c in t)  # 1 + 2 + 2 tokens
    assert max(engine.live_per_step) == concurrency
    # each trajectory's calls go in one after the other, in order
    for t in trajectories:
        assert [p for p in engine.added if p in t] == t


@needs_traces
@pytest.mark.slow
def test_profile_hybrid_splits_the_hybrids_difference(tmp_path, acr_traces):
    from profile_hybrid import main

    out = tmp_path / "profile.json"
    assert main(["--traces", str(acr_traces), "--trajectories", "1", "--calls-per-trajectory", "2",
                 "--max-new-tokens", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["calls"] == 2 and result["identical_calls"] == {"suffix": 2, "suffix+peagle": 2}
    suffix, hybrid = result["methods"]["suffix"], result["methods"]["suffix+peagle"]
    assert suffix["drafter_runs_per_step"] == 0 and hybrid["drafter_runs_per_step"] > 0  # its first step at least
    assert suffix["new_tokens"] == hybrid["new_tokens"] > 0
    split = result["difference"]["suffix+peagle"]
    assert set(split) == {"propose_ms_per_token", "verify_ms_per_token", "update_ms_per_token", "decode_ms_per_token"}
    assert split["propose_ms_per_token"] > 0  # the drafter's passes cost something
