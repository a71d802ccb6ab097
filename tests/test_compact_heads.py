"""The compact form of drafter checkpoints (issue 35): 8-bit matrices with a scale per row round-trip within half a
step, a compact checkpoint loads and drafts exactly as the plain bfloat16 file expanded from it (what vLLM reads),
the two forms never go stale against each other, and the shipped heads are compact and load."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridspec.speculators import TargetFeatures, load_drafter, save_drafter
from hybridspec.speculators.compact import main, shipped_dirs
from hybridspec.speculators.formats import (COMPACT_WEIGHTS, WEIGHTS, compress_checkpoint, expand_checkpoint,
                                           read_weights, weights_file)
from hybridspec.speculators.quantize import FORMAT, QUANT, SCALE, dequantize, quantize, quantize_rows

from test_speculators import KINDS, K, make_drafter


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The tiny target, a greedy continuation of it and its features."""
    from test_speculators import greedy_sequence

    return tiny_model, greedy_sequence(tiny_model)


def test_quantize_round_trips_within_half_a_step_per_row():
    torch.manual_seed(0)
    weight = torch.randn(300, 200) * torch.logspace(-3, 1, 300)[:, None]  # rows of very different magnitudes
    weight[7] = 0.0  # an all-zero row
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and q.abs().max() <= 127
    back = dequantize({"w" + QUANT: q, "w" + SCALE: scale}, torch.float32)["w"]
    step = scale.float()[:, None]
    # int8 rounding (half a step, a little more where the row's largest value was clipped by the bfloat16 scale)
    # plus bfloat16 rounding of the result
    assert ((back - weight).abs() <= 0.51 * step + weight.abs() * 2 ** -8).all()
    assert (back[7] == 0).all()
    rel = (back - weight).norm(dim=1) / weight.norm(dim=1).clamp_min(1e-12)
    assert rel.max() < 0.01


def test_quantize_keeps_small_and_integer_tensors():
    weights = {"fc.weight": torch.randn(64, 96), "norm.weight": torch.randn(64), "mask_hidden": torch.randn(1, 96),
               "d2t": torch.arange(10), "t2d": torch.rand(20) > 0.5}
    stored = quantize(weights)
    assert set(stored) == {"fc.weight" + QUANT, "fc.weight" + SCALE, "norm.weight", "mask_hidden", "d2t", "t2d"}
    assert stored["norm.weight"].dtype == torch.bfloat16 and stored["mask_hidden"].dtype == torch.bfloat16
    back = dequantize(stored, torch.float32)
    assert set(back) == set(weights)
    assert torch.equal(back["d2t"], weights["d2t"]) and torch.equal(back["t2d"], weights["t2d"])
    assert torch.equal(back["norm.weight"], weights["norm.weight"].bfloat16().float())
    # whatever the dtype asked for, the values are the bfloat16 ones
    assert torch.equal(dequantize(stored, torch.bfloat16)["fc.weight"].float(), back["fc.weight"])
    with pytest.raises(ValueError, match="q8"):
        quantize({"x" + QUANT: torch.randn(32, 32)})
    with pytest.raises(ValueError):
        dequantize({"fc.weight" + QUANT: stored["fc.weight" + QUANT]})


def _proposals(drafter, sequence):
    tokens, features = sequence
    return [drafter.propose(drafter.begin(features, tokens[1:]), k) for k in (1, K)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_compact_checkpoint_drafts_as_its_expanded_form(kind, tiny, tmp_path):
    target, sequence = tiny
    drafter = make_drafter(kind, target)
    embed = target.get_input_embeddings().weight
    compact = save_drafter(drafter, tmp_path / "compact", verifier_name_or_path="tiny", compact=True)
    assert not (compact / WEIGHTS).exists() and weights_file(compact).name == COMPACT_WEIGHTS
    with safe_open(str(compact / COMPACT_WEIGHTS), "pt") as f:
        assert f.metadata()["hybridspec_weights"] == FORMAT
    assert json.loads((compact / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    plain = save_drafter(drafter, tmp_path / "plain", dtype=torch.bfloat16)
    assert (compact / COMPACT_WEIGHTS).stat().st_size < 0.6 * (plain / WEIGHTS).stat().st_size

    expanded = expand_checkpoint(compact, into=tmp_path / "expanded")  # a copy for vLLM
    assert sorted(p.name for p in expanded.iterdir()) == ["config.json", WEIGHTS]
    a = load_drafter(compact, target=target.config, embed_tokens=embed)
    b = load_drafter(expanded, target=target.config, embed_tokens=embed)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    for x, y in zip(_proposals(a, sequence), _proposals(b, sequence)):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(x.draft_logits, y.draft_logits, rtol=0, atol=0)
    # and near the float32 original
    for name, tensor in drafter.state_dict().items():
        if tensor.is_floating_point() and not name.startswith("embed_tokens"):
            err = (a.state_dict()[name] - tensor).norm() / tensor.norm().clamp_min(1e-12)
            assert err < 0.02, name


def test_expanded_file_follows_its_compact_file(tiny, tmp_path):
    target = tiny[0]
    embed = target.get_input_embeddings().weight
    path = save_drafter(make_drafter("peagle", target, seed=0), tmp_path / "head", compact=True)
    assert main(["expand", str(path)]) == 0  # beside it, as scripts/setup.sh does for the shipped heads
    assert weights_file(path).name == WEIGHTS
    first = (path / WEIGHTS).read_bytes()
    expand_checkpoint(path)  # current: kept as it is
    assert (path / WEIGHTS).read_bytes() == first

    # the compact file changes under it (a pull): the stale plain file is not read, and expanding writes it again
    other = save_drafter(make_drafter("peagle", target, seed=1), tmp_path / "other", compact=True)
    (path / COMPACT_WEIGHTS).write_bytes((other / COMPACT_WEIGHTS).read_bytes())
    assert weights_file(path).name == COMPACT_WEIGHTS
    fresh = load_drafter(other, target=target.config, embed_tokens=embed).state_dict()
    loaded = load_drafter(path, target=target.config, embed_tokens=embed).state_dict()
    assert all(torch.equal(loaded[n], fresh[n]) for n in fresh)
    expand_checkpoint(path)
    assert weights_file(path).name == WEIGHTS and (path / WEIGHTS).read_bytes() != first

    # saving one form removes the other; a plain file of its own (not expanded) is read as it is
    save_drafter(make_drafter("peagle", target, seed=2), path)
    assert not (path / COMPACT_WEIGHTS).exists() and weights_file(path).name == WEIGHTS
    compress_checkpoint(path)
    assert not (path / WEIGHTS).exists() and weights_file(path).name == COMPACT_WEIGHTS
    with pytest.raises(FileNotFoundError):
        weights_file(tmp_path)


def test_shipped_heads_are_compact_and_draft_as_their_expanded_form(tmp_path):
    dirs = {p.name: p for p in shipped_dirs()}
    assert set(dirs) == {f"{k}-smollm2" for k in KINDS}
    torch.manual_seed(0)
    for name, path in dirs.items():
        assert (path / COMPACT_WEIGHTS).is_file(), name
        config = json.loads((path / "config.json").read_text())
        hidden = config.get("target_hidden_size") or config.get("input_hidden_dim")
        vocab = config.get("vocab_size") or config["transformer_layer_config"]["vocab_size"]
        embed = torch.randn(vocab, hidden) * 0.02
        expanded = expand_checkpoint(path, into=tmp_path / name)
        a, b = (load_drafter(p, embed_tokens=embed) for p in (path, expanded))
        stored = load_file(str(expanded / WEIGHTS))
        assert all(t.dtype == torch.bfloat16 for t in stored.values() if t.is_floating_point())
        assert stored.keys() == read_weights(path).keys()
        n = 24
        aux_width = len(getattr(a, "aux_layer_ids", ()) or ()) * hidden or hidden
        features = TargetFeatures(torch.randn(n, aux_width), torch.randn(n, hidden))
        tokens = torch.randint(0, vocab, (n,))
        with torch.no_grad():
            x, y = (d.propose(d.begin(features, tokens), d.num_speculative_tokens) for d in (a, b))
        assert x.token_ids == y.token_ids, name
        torch.testing.assert_close(x.draft_logits, y.draft_logits, rtol=0, atol=0)


def test_plain_checkpoint_without_its_compact_file_still_loads(tiny_model, tmp_path):
    drafter = make_drafter("lstm", tiny_model)
    path = save_drafter(drafter, tmp_path / "plain")
    stored = load_file(str(path / WEIGHTS))
    save_file(stored, str(path / WEIGHTS), metadata={"format": "pt", "expanded_from": "0" * 64})
    # an expanded file whose compact file is gone is still the checkpoint's weights
    assert weights_file(path).name == WEIGHTS
    load_drafter(path)
