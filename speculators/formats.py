"""Checkpoint formats that vLLM reads.

P-EAGLE and EAGLE-3: the `speculators` format (vllm-project/speculators; vLLM's `SpeculatorsConfig` and
`llama_eagle3.py`): config.json with `speculators_model_type` ("peagle" | "eagle3"), `transformer_layer_config` (a
Llama config of the drafter's layers, vocab_size = the target's), `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids`, `norm_before_residual` (written explicitly: vLLM's default differs between
eagle3 (True) and peagle (False)), `mask_token_id` (P-EAGLE, required by vLLM), `independent_layers` (FastEagle: true
when every layer reads the fused features, the no-cascade ablation; num_hidden_layers is its number of draft
positions; vLLM runs it through hybridspec's plugin, HYBRIDSPEC_VLLM=fasteagle) and `speculators_config` (proposal
method with speculative_tokens, verifier); weights in model.safetensors named fc.weight, layers.N.*, norm.weight,
lm_head.weight, d2t (offsets: target id = i + d2t[i]), t2d (bool mask), mask_hidden ([1, 3H], P-EAGLE). The input
embedding is the target's and is not stored (vLLM shares it when `embed_tokens` is absent).

LSTM: the Arctic speculator format (ArcticTraining's ArcticLSTMSpeculatorConfig, read by ArcticInference's
ArcticLSTMSpeculator): config.json with model_type "mlp_speculator", method "sum_lstm", input_hidden_dim,
inner_dim/proj_dim/emb_dim (strings), vocab_size, n_predict, tie_weights, tie_lstm_embs, scale_input; weights
forget_emb.0, projs.0, projs.1, cell_ln.0, state_ln.0, head.0 (tied heads are stored once).

Compact form (`save_drafter(compact=True)`, the shipped heads): the same config.json beside model.safetensors.q8, the
weights with 8-bit matrices (`quantize.py`), for a checkout and a wheel half the size; its name does not end in
.safetensors, since vLLM loads every *.safetensors file of a checkpoint directory. Only this runtime reads it;
`expand_checkpoint` writes the plain bfloat16 model.safetensors beside it (or into a copy) for vLLM, recording the
compact file's hash, and `load_drafter` reads model.safetensors when present and current, else the compact file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from hybridspec.speculators.drafter import Drafter
from hybridspec.speculators.eagle import EagleBase, EagleConfig
from hybridspec.speculators.features import TargetInfo, default_aux_layer_ids
from hybridspec.speculators.layers import LayerConfig
from hybridspec.speculators.lstm import LSTMConfig, LSTMDrafter
from hybridspec.speculators.quantize import FORMAT as COMPACT_FORMAT
from hybridspec.speculators.quantize import dequantize, quantize
from hybridspec.speculators.registry import ARCTIC_FORMAT, DRAFTERS, SPECULATORS_FORMAT, kinds_in_format

WEIGHTS = "model.safetensors"
COMPACT_WEIGHTS = "model.safetensors.q8"
CONFIG = "config.json"
SPECULATORS_VERSION = "0.3.0"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weights(drafter: Drafter, dtype: torch.dtype | None, skip: Sequence[str] = ()) -> dict[str, Tensor]:
    out = {}
    for name, tensor in drafter.state_dict().items():
        if any(name.startswith(s) for s in skip):
            continue
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    return out


def _write(path: Path, config: dict[str, Any], weights: dict[str, Tensor], compact: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # Write then rename, so an interrupted save never leaves a checkpoint that loads half-old, half-new.
    name, other = (COMPACT_WEIGHTS, WEIGHTS) if compact else (WEIGHTS, COMPACT_WEIGHTS)
    tmp_weights, tmp_config = path / (name + ".tmp"), path / (CONFIG + ".tmp")
    metadata = {"format": "pt", **({"hybridspec_weights": COMPACT_FORMAT} if compact else {})}
    save_file(quantize(weights) if compact else weights, str(tmp_weights), metadata=metadata)
    tmp_config.write_text(json.dumps(config, indent=2) + "\n")
    (path / other).unlink(missing_ok=True)  # the other form's weights are the old ones now
    os.replace(tmp_weights, path / name)
    os.replace(tmp_config, path / CONFIG)


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _expanded_from(file: Path) -> str | None:
    with safe_open(str(file), "pt") as f:
        return (f.metadata() or {}).get("expanded_from")


def weights_file(path: str | os.PathLike) -> Path:
    """The file `load_drafter` reads: model.safetensors, unless it was expanded from a compact file that has changed
    since (then the compact file), else model.safetensors.q8."""
    plain, compact = Path(path) / WEIGHTS, Path(path) / COMPACT_WEIGHTS
    if plain.is_file():
        source = _expanded_from(plain) if compact.is_file() else None
        if source is None or source == _sha256(compact):
            return plain
    if compact.is_file():
        return compact
    raise FileNotFoundError(f"{path} holds no drafter weights ({WEIGHTS} or {COMPACT_WEIGHTS})")


def read_weights(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The checkpoint's state dict as stored (dtype None) or with floating tensors in `dtype`; a compact file comes
    back dequantized, equal to the model.safetensors `expand_checkpoint` writes from it."""
    file = weights_file(path)
    stored = load_file(str(file))
    if file.name == COMPACT_WEIGHTS:
        return dequantize(stored, dtype or torch.bfloat16)
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in stored.items()}


def expand_checkpoint(path: str | os.PathLike, into: str | os.PathLike | None = None) -> Path:
    """The checkpoint as vLLM reads it: a plain bfloat16 model.safetensors written from the compact file, beside it
    (into None) or in `into` with a copy of config.json. Returns the directory. A model.safetensors that is already
    current is kept (into: copied); a checkpoint with no compact file is only copied."""
    src = Path(path)
    dst = Path(into) if into is not None else src
    if dst != src:
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / CONFIG, dst / CONFIG)
    file = weights_file(src)
    if file.name == WEIGHTS:
        if dst != src:
            shutil.copy(file, dst / WEIGHTS)
        return dst
    weights = read_weights(src)
    tmp = dst / (WEIGHTS + ".tmp")
    save_file(weights, str(tmp), metadata={"format": "pt", "expanded_from": _sha256(file)})
    os.replace(tmp, dst / WEIGHTS)
    return dst


def compress_checkpoint(path: str | os.PathLike) -> Path:
    """Rewrite the plain checkpoint at `path` in its compact form: writes model.safetensors.q8 and removes
    model.safetensors. Returns the compact file."""
    path = Path(path)
    _write(path, read_config(path), load_file(str(path / WEIGHTS)), compact=True)
    return path / COMPACT_WEIGHTS


# ---------------------------------------------------------------------------------------------------------------------
# speculators format (P-EAGLE, EAGLE-3)


def eagle_config_dict(drafter: EagleBase, verifier_name_or_path: str = "", verifier_architectures: Sequence[str] = (),
                      dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    cfg, layer = drafter.config, drafter.config.layer
    kind = drafter.name
    layer_config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.target_vocab_size,
        "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads, "head_dim": layer.head_dim, "hidden_act": "silu",
        "rms_norm_eps": layer.rms_norm_eps, "max_position_embeddings": layer.max_position_embeddings,
        # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": layer.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": layer.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }
    config: dict[str, Any] = {
        "architectures": [DRAFTERS[kind].architecture],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "tie_word_embeddings": False,
        "dtype": _dtype_name(dtype),
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
    }
    if kind == "peagle":
        config["mask_token_id"] = cfg.mask_token_id
    if kind == "fasteagle":
        config["independent_layers"] = cfg.independent_layers
    return config


def _eagle_from_config(config: dict[str, Any]) -> tuple[type[EagleBase], EagleConfig]:
    kind = config["speculators_model_type"]
    kinds = kinds_in_format(SPECULATORS_FORMAT)
    if kind not in kinds:
        raise ValueError(f"unsupported speculators_model_type {kind!r}; this loader reads {sorted(kinds)}")
    layer = config.get("transformer_layer_config") or config.get("transformer_config")
    if not isinstance(layer, dict):
        raise ValueError("a speculators config needs a transformer_layer_config dictionary")
    rope = layer.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only default RoPE is supported in drafter layers, got {rope.get('rope_type')!r}")
    heads = layer["num_attention_heads"]
    layer_cfg = LayerConfig(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads, rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
        max_position_embeddings=layer.get("max_position_embeddings", 8192))
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError("the checkpoint does not say which target layers it reads (eagle_aux_hidden_state_layer_ids); "
                         "pass aux_layer_ids= to load it against the layers it was trained on")
    eagle = EagleConfig(
        layer=layer_cfg, num_layers=layer["num_hidden_layers"],
        target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
        target_vocab_size=layer["vocab_size"], draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
        aux_layer_ids=tuple(ids), norm_before_residual=bool(config.get("norm_before_residual", kind == "eagle3")),
        mask_token_id=config.get("mask_token_id"), independent_layers=bool(config.get("independent_layers", False)),
        num_speculative_tokens=int(proposals[0].get("speculative_tokens", 3)))
    return kinds[kind].drafter, eagle


# ---------------------------------------------------------------------------------------------------------------------
# Arctic LSTM format


def lstm_config_dict(drafter: LSTMDrafter, verifier_name_or_path: str = "",
                     dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    c = drafter.config
    return {
        "architectures": [DRAFTERS[drafter.name].architecture], "base_model_name_or_path": verifier_name_or_path,
        "model_type": "mlp_speculator", "method": "sum_lstm", "input_hidden_dim": c.input_hidden_dim,
        "inner_dim": str(c.dim), "proj_dim": str(c.dim), "emb_dim": str(c.dim), "vocab_size": c.vocab_size,
        # n_predict is the format's name (vLLM and ArcticInference read it) for num_speculative_tokens
        "n_predict": c.num_speculative_tokens, "n_candidates": c.num_speculative_tokens,
        "num_lookahead_tokens": c.num_speculative_tokens, "top_k_tokens_per_head": [1] * c.num_speculative_tokens,
        "tie_weights": True, "tie_lstm_embs": True,
        "scale_input": c.scale_input, "torch_dtype": _dtype_name(dtype),
    }


def _lstm_from_config(config: dict[str, Any]) -> LSTMConfig:
    if config.get("method") != "sum_lstm" or not config.get("tie_weights") or not config.get("tie_lstm_embs"):
        raise ValueError("only Arctic LSTM speculators with method 'sum_lstm', tie_weights and tie_lstm_embs are "
                         f"supported, got method={config.get('method')!r} tie_weights={config.get('tie_weights')} "
                         f"tie_lstm_embs={config.get('tie_lstm_embs')}")
    dims = {key: [int(x) for x in str(config[key]).split(".")] for key in ("inner_dim", "proj_dim", "emb_dim")}
    if any(len(v) != 1 for v in dims.values()) or len({v[0] for v in dims.values()}) != 1:
        raise ValueError(f"sum_lstm needs one equal inner/proj/emb dimension, got {dims}")
    return LSTMConfig(input_hidden_dim=int(config["input_hidden_dim"]), dim=dims["inner_dim"][0],
                      vocab_size=int(config["vocab_size"]), num_speculative_tokens=int(config["n_predict"]),
                      scale_input=bool(config.get("scale_input", False)))


# ---------------------------------------------------------------------------------------------------------------------
# public API


def save_drafter(drafter: Drafter, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 verifier_name_or_path: str = "", verifier_architectures: Sequence[str] = (),
                 save_embeddings: bool = False, compact: bool = False) -> Path:
    """Write `drafter` to the directory `path` in the format vLLM reads for its kind. dtype: cast floating weights
    (e.g. torch.bfloat16 for a smaller file; None keeps them). The shared target embedding is stored only when
    save_embeddings (vLLM then uses it instead of the target's). compact: write model.safetensors.q8 (8-bit matrices,
    see quantize.py) instead of model.safetensors; vLLM needs `expand_checkpoint` first."""
    path = Path(path)
    dtype_written = torch.bfloat16 if compact else dtype or next(drafter.parameters()).dtype
    if isinstance(drafter, LSTMDrafter):
        config = lstm_config_dict(drafter, verifier_name_or_path, dtype_written)
        _write(path, config, _weights(drafter, dtype), compact)
    elif isinstance(drafter, EagleBase):
        config = eagle_config_dict(drafter, verifier_name_or_path, verifier_architectures, dtype_written)
        _write(path, config, _weights(drafter, dtype, skip=() if save_embeddings else ("embed_tokens.",)), compact)
    else:
        raise TypeError(f"no checkpoint format for {type(drafter).__name__}")
    return path


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a drafter checkpoint directory (no {CONFIG})")
    return json.loads(file.read_text())


def load_drafter(path: str | os.PathLike, *, target: Any = None, embed_tokens: Tensor | None = None,
                 aux_layer_ids: Sequence[int] | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Drafter:
    """Load a P-EAGLE / EAGLE-3 / FastEagle (speculators format) or LSTM (Arctic format) drafter, from its
    model.safetensors or its compact model.safetensors.q8 (`weights_file`).

    target: the target's config (or a TargetInfo); when given, a drafter whose vocabulary, hidden size or aux layer
    ids do not fit it raises ValueError. aux_layer_ids: the layers the runtime captures, checked against the
    checkpoint's. embed_tokens: the target's input embedding [V, H], needed by EAGLE-family checkpoints that do not
    store their own.
    """
    config = read_config(path)
    weights = read_weights(path)
    drafter: Drafter
    if "speculators_model_type" in config:
        if not config.get("eagle_aux_hidden_state_layer_ids") and target is not None:
            # vLLM's fallback for checkpoints that do not record their layers; made explicit here.
            config["eagle_aux_hidden_state_layer_ids"] = list(default_aux_layer_ids(TargetInfo.of(target).num_layers))
        cls, eagle = _eagle_from_config(config)
        stored = weights.pop("embed_tokens.weight", None)
        embedding = stored if stored is not None else embed_tokens
        if embedding is None:
            raise ValueError(f"{path} does not store an input embedding: pass the target's as embed_tokens=")
        drafter = cls(eagle, embed_tokens=embedding.to(dtype))
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
        missing = [m for m in missing if not m.startswith("embed_tokens.")]
    elif config.get("model_type") == "mlp_speculator" or any(
            kind.architecture in config.get("architectures", []) for kind in kinds_in_format(ARCTIC_FORMAT).values()):
        drafter = LSTMDrafter(_lstm_from_config(config))
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
    else:
        raise ValueError(f"{path}: neither a speculators-format (speculators_model_type) nor an Arctic LSTM "
                         f"(model_type mlp_speculator) checkpoint")
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    if target is not None:
        drafter.check_target(target, aux_layer_ids)
    elif drafter.aux_layer_ids and aux_layer_ids is not None and list(aux_layer_ids) != list(drafter.aux_layer_ids):
        raise ValueError(f"the runtime captures layers {list(aux_layer_ids)} but the drafter was trained on "
                         f"{list(drafter.aux_layer_ids)}")
    return drafter.to(device=device, dtype=dtype).eval()
