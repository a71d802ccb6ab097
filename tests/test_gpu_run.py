"""`hybridspec gpu-run`: the weights' pack / stage round trip and the dequantizer, the recipes' items that travel with
them, and the whole run at a tiny scale on the CPU (a random target, a few recipe items and filler prompts, a few
steps): the recipes' held-out items are the held-out split and never trained on, the output folder holds what a device
call can bring back, and the heads it wrote load in an Engine whose greedy output is plain greedy decoding's."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hybridspec.tools import gpu_items as gi
from hybridspec.tools import gpu_weights as gw

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def test_dequantizer_matches_gguf_bit_for_bit():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    for qtype in ("Q4_1", "Q8_0"):
        blocks = rng.integers(0, 256, size=(64, gw.BLOCK_BYTES[qtype]), dtype=np.uint8)
        blocks[:, :4] = np.frombuffer(rng.normal(size=(64, 2)).astype(np.float16).tobytes(), np.uint8).reshape(64, 4)
        want = dequantize(blocks.reshape(4, -1), getattr(gguf.GGMLQuantizationType, qtype)).reshape(4, 512)
        got = gw.dequantize(qtype, blocks.reshape(-1), [4, 512])
        assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), qtype


def fake_payload(seed: int = 0) -> tuple[bytes, dict[str, np.ndarray]]:
    """A payload in pack's format: Q8_0, Q4_1 and F32 tensors and a config; returns it and the tensors it decodes to."""
    from safetensors.numpy import save

    rng = np.random.default_rng(seed)
    tensors, meta = {}, {}
    for name, qtype, shape in (("model.embed_tokens.weight", "Q8_0", [8, 64]), ("model.layers.0.mlp.up_proj.weight",
                                                                             "Q4_1", [16, 64]),
                               ("model.norm.weight", "F32", [64])):
        n = int(np.prod(shape))
        if qtype == "F32":
            raw = rng.normal(size=n).astype(np.float32).view(np.uint8)
        else:
            raw = rng.integers(0, 256, size=(n // 32, gw.BLOCK_BYTES[qtype]), dtype=np.uint8)
            raw[:, :2] = np.frombuffer(np.full(n // 32, 0.5, np.float16).tobytes(), np.uint8).reshape(-1, 2)
            raw[:, 2:4] = 0 if qtype == "Q4_1" else raw[:, 2:4]
        tensors[name], meta[name] = raw.reshape(-1), {"type": qtype, "shape": shape}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(gw.QUANT_FILE, save(tensors, metadata={"tensors": json.dumps(meta)}))
        z.writestr("config.json", json.dumps({"num_attention_heads": 2, "num_key_value_heads": 1, "seed": seed}))
        z.writestr(gi.ITEMS_FILE, gi.items_jsonl({"heldout_fraction": 0.1}, recipe_items()))
    payload = buf.getvalue()
    return payload, gw.state_dict_from_payload(payload)[0]


def recipe_items() -> dict[str, list]:
    """A few items as the recipes split them: held-out chat and agent prompts, training prompts and a text item."""
    from hybridspec.speculators.train.text import Item

    mt, he, ag = "mt_bench:mt_bench_questions.jsonl", "humaneval:HumanEval.jsonl.gz", "agent_traces:agent_traces"
    return {"heldout": [Item(mt, "Q1: name a fruit"), Item(he, "Q2: def add(a, b):"), Item(ag, "Q3: run ls -la")],
            "train": [Item(mt, "T1: name a colour"), Item(he, "T2: def mul(a, b):"), Item(ag, "T3: run git log"),
                      Item(mt, "T4: count to five"), Item(ag, "T5: open the file", "cat file.txt")]}


def test_recipe_items_combine_keeps_heldout_out():
    from hybridspec.speculators.train.text import Item, heldout

    items = recipe_items()
    filler = [Item("jsonl:p.jsonl", f"prompt number {i}") for i in range(200)]
    filler += [Item("jsonl:p.jsonl", "Q1: name a fruit"), items["train"][0]]  # a held-out prompt, a recipe item
    combined, counts = gi.combine(items, {"train": filler, "heldout": []}, 0.25)
    assert combined["heldout"] == items["heldout"]
    assert combined["train"][:5] == items["train"]  # the recipes' items first
    extra = combined["train"][5:]
    assert extra and all(not heldout(i, 0.25) for i in extra)
    assert "Q1: name a fruit" not in {i.prompt for i in combined["train"]}
    assert len(combined["train"]) == len({i.key for i in combined["train"]})
    assert counts["filler_train"] == len(extra) and counts["filler_train_dropped"] == len(filler) - len(extra)


@pytest.mark.skipif(not (SHARED / "workloads").is_dir(), reason="the recipes' sources (../shared) are not here")
def test_pack_items_are_the_recipes_split(tmp_path):
    import zlib

    from hybridspec.speculators.train import load_recipe
    from hybridspec.speculators.train.text import load_items

    data, header = gi.pack_items(ROOT)
    path = tmp_path / gi.ITEMS_FILE
    path.write_bytes(data)
    read_header, items = gi.read_items(path)
    recipe = load_recipe(ROOT / "speculators" / "recipes" / gi.RECIPE)
    assert items == load_items(recipe, skip_ungenerated=True)  # the same items, split and order
    assert read_header["heldout_fraction"] == recipe.data.heldout_fraction == 0.1
    kinds = {i.source.split(":")[0] for split in items.values() for i in split}
    assert {"mt_bench", "humaneval", "agent_traces"} <= kinds
    assert items["heldout"] and not {i.prompt for i in items["heldout"]} & {i.prompt for i in items["train"]}
    assert len(zlib.compress(data)) < 1 << 20  # compact beside the weights


def carry(parts: Path, checkout: Path, indices: list[int]) -> None:
    """What a device call does with `carry`: the named part folders replace .gpu/parts there."""
    dest = checkout / ".gpu" / "parts"
    shutil.rmtree(dest, ignore_errors=True)
    for i in indices:
        shutil.copytree(parts / f"{i:02d}", dest / f"{i:02d}")


def test_pack_and_stage_round_trip(tmp_path):
    from safetensors.numpy import load_file

    payload, tensors = fake_payload()
    here, there = tmp_path / "here", tmp_path / "there"
    manifest = gw.write_parts(payload, here / "parts", part_bytes=len(payload) // 3 + 1)
    assert len(manifest["parts"]) == 3
    assert gw.stage(there)["reason"].startswith("no parts carried")
    carry(here / "parts", there, [1, 3])
    status = gw.stage(there)
    assert (status["complete"], status["present"], status["missing"]) == (False, [1, 3], [2])
    carry(here / "parts", there, [2])  # a later call carries the last one: the store kept the others
    status = gw.stage(there)
    assert status["complete"] and status["missing"] == []
    got = load_file(str(Path(status["target"]) / "model.safetensors"))
    assert set(got) == set(tensors) and all(np.array_equal(got[k], tensors[k]) for k in tensors)
    assert json.loads((Path(status["target"]) / "config.json").read_text())["seed"] == 0
    assert gi.read_items(Path(status["target"]) / gi.ITEMS_FILE)[1] == recipe_items()  # staged beside the target
    assert gw.stage(there)["target"] == status["target"]  # staged once; a later call finds it

    # a corrupt part is refused with its name; parts of two packs are refused
    carry(here / "parts", there, [2])
    part = there / ".gpu" / "parts" / "02" / "part.bin"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(gw.StagingError, match="part 02"):
        gw.stage(there)
    other, _ = fake_payload(seed=1)
    gw.write_parts(other, here / "other", part_bytes=len(other) // 2 + 1)
    carry(here / "parts", there, [1])
    shutil.copytree(here / "other" / "02", there / ".gpu" / "parts" / "02")
    with pytest.raises(gw.StagingError, match="different packs"):
        gw.stage(there)

    # a new pack replaces the old one in the store; a part corrupted in the store is found when assembling
    carry(here / "other", there, [1, 2])
    status = gw.stage(there)
    assert status["complete"] and status["payload_sha256"] == gw.sha256(other)
    gw.write_parts(payload, here / "parts", part_bytes=len(payload) // 3 + 1)
    carry(here / "parts", there, [1, 2])
    assert gw.stage(there)["missing"] == [3]
    store = there / ".gpu" / "store"
    carry(here / "parts", there, [3])
    (store / "01.bin").write_bytes(b"y" + (store / "01.bin").read_bytes()[1:])
    with pytest.raises(gw.StagingError, match=r"parts \[1\]"):
        gw.stage(there)
    assert not (store / "01.bin").exists()


@pytest.mark.slow
def test_gpu_run_tiny_end_to_end(tmp_path, tiny_model, tiny_tokenizer):
    from hybridspec.model.target import TargetModel
    from hybridspec.runtime.engine import Engine

    target = tmp_path / "target"
    tiny_model.generation_config.pad_token_id = 2
    tiny_model.save_pretrained(target)
    tiny_tokenizer.save_pretrained(target)
    items = recipe_items()  # staged beside the target, as `stage` leaves them
    (target / gi.ITEMS_FILE).write_bytes(gi.items_jsonl({"heldout_fraction": 0.1}, items))
    prompts = tmp_path / "prompts.jsonl"  # the filler; one of them is a held-out item's prompt
    prompts.write_text("".join(json.dumps({"text": f"Task {i}: list the files in dir{i}, sorted."}) + "\n"
                               for i in range(24)) + json.dumps({"text": items["heldout"][0].prompt}) + "\n")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDSPEC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "hybridspec.tools.gpu_run", "run", "--scale", "tiny", "--target",
                           str(target), "--prompts", str(prompts), "--out", str(out), "--work", str(work),
                           "--budget-s", "240"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert {"figures.json", "gpu_run.log", "fasteagle-smollm2.zip", "peagle-smollm2.zip"} <= set(files)
    assert len(files) <= 8 and max(files.values()) < 16 * 2**20, files
    figures = json.loads((out / "figures.json").read_text())
    assert all(p["status"] == "ok" for p in figures["phases"].values()), figures["phases"]
    kernels = figures["checks"]["verifier_kernels"]
    assert kernels and all(v["equal"] for row in kernels for k, v in row.items() if isinstance(v, dict))
    assert figures["checks"]["verify_cost_target"]["ms_by_context_and_tokens"]["16"]
    assert "skipped" in figures["checks"]["verify_cost_llama8b_shape"]
    data = figures["data"]
    assert data["train"]["sequences"] > 0 and data["heldout"]["sequences"] > 0
    # the recipes' items: answered first (both splits), the held-out split is theirs, the filler only trains
    assert figures["recipe_items"]["heldout"] == 3 and figures["recipe_items"]["train"] == 5
    assert data["recipe_responses"]["responses"] == 7  # every item without a response text
    assert data["items"]["recipe_heldout"] == 3 and data["items"]["filler_train"] > 0
    assert set(data["heldout"]["by_source"]) <= {"mt_bench", "humaneval", "agent_traces"}
    assert data["train"]["by_source"]["jsonl"] == data["items"]["filler_train"]
    assert held_out_never_trained(work / "features", items["heldout"], tiny_tokenizer)
    for kind in ("fasteagle", "peagle"):
        trained = figures["training"][kind]
        assert trained["steps"] == 3 and "acceptance@3" in trained["final_eval"]
        assert {"chat", "agent"} <= set(trained["heldout_by_text"]), trained["heldout_by_text"]
        assert figures["trained_head_latency"][f"{kind}-smollm2"]["ms@16"] > 0
        with zipfile.ZipFile(out / f"{kind}-smollm2.zip") as z:
            z.extractall(tmp_path / "heads")
        engine = Engine(TargetModel(tiny_model), tiny_tokenizer,
                        drafters={kind: str(tmp_path / "heads" / f"{kind}-smollm2")})
        prompt = tiny_tokenizer("Task 3: list the files")["input_ids"]
        spec = engine.generate(prompt, max_new_tokens=24, speculate=kind)
        plain = engine.generate(prompt, max_new_tokens=24, speculate="none")
        assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 0


def held_out_never_trained(features: Path, held: list, tokenizer) -> bool:
    """No training sequence starts with a held-out item's prompt (as the data step templates and cuts it), and every
    held-out sequence does."""
    from safetensors.torch import load_file

    from hybridspec.speculators.train.data import _prompt_ids
    from hybridspec.tools.gpu_run import SCALES

    cut = SCALES["tiny"]["data"]["max_prompt_tokens"]
    prompts = [_prompt_ids(tokenizer, i.prompt, cut) for i in held]
    starts = {}
    for split in ("train", "heldout"):
        starts[split] = []
        for shard in sorted(features.glob(f"{split}-*.safetensors")):
            t = load_file(str(shard))
            for a, b in zip(t["offsets"][:-1].tolist(), t["offsets"][1:].tolist()):
                starts[split].append(t["tokens"][a:b].tolist())
    assert starts["train"] and starts["heldout"]
    trained = any(seq[: len(p)] == p for seq in starts["train"] for p in prompts)
    return not trained and all(any(seq[: len(p)] == p for p in prompts) for seq in starts["heldout"])


def test_shipped_heads_draft_in_bfloat16():
    """The GPU run times every shipped EAGLE-family head in bfloat16 (as on CUDA): the rotary embedding must keep
    the activations' dtype, and EAGLE-3's chain must fit in the slots it is given."""
    import torch

    from hybridspec.tools.gpu_checks import head_latencies

    heads = sorted(p for p in (ROOT / "speculators" / "checkpoints").iterdir() if p.is_dir())
    heads.append(ROOT / "speculators" / "checkpoints" / "peagle-smollm2")  # as a trained head of the same name
    timed = head_latencies(heads, torch.device("cpu"), [16], repeats=1, dtype=torch.bfloat16)
    eagles = {"eagle3-smollm2", "fasteagle-smollm2", "peagle-smollm2", "checkpoints/peagle-smollm2"}
    assert eagles <= set(timed), timed
    for name in eagles:
        assert timed[name].get("ms@16", 0) > 0 and timed[name]["k"] == 7, timed[name]
    assert "skipped" in timed["lstm-smollm2"]


def test_rotary_keeps_dtype_and_float32_frequencies():
    import torch

    from hybridspec.speculators.layers import Rotary, apply_rotary

    rotary = Rotary(64, 100000.0).to(torch.bfloat16)  # a bfloat16 drafter must not round the frequencies
    cos, sin = rotary(torch.arange(4096))
    exact = Rotary(64, 100000.0)(torch.arange(4096))
    assert cos.dtype == torch.float32 and torch.equal(cos, exact[0]) and torch.equal(sin, exact[1])
    x = torch.randn(2, 4096, 64, dtype=torch.bfloat16)
    y = apply_rotary(x, cos, sin)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), apply_rotary(x.float(), cos, sin), atol=1e-2, rtol=1e-2)
