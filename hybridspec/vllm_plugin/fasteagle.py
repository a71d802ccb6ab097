"""FastEagle heads in vLLM (HYBRIDSPEC_VLLM=fasteagle): what vLLM's speculators-format reader and model registry need
to build one, with nothing of vLLM imported here (the model class is `fasteagle_model`, imported by vLLM's registry
only when a FastEagle head is loaded).

A FastEagle checkpoint (config `speculators_model_type: "fasteagle"`) runs as vLLM's `method: "eagle3"` with
`parallel_drafting: true`: vLLM's EAGLE proposer feeds the real slots (the target's aux hidden states through `fc`,
the next tokens) followed by K-1 parallel slots per request, and reads draft j from slot j's output. The model class
puts layer j's output at the last real slot there (`fasteagle_model`), so the K drafts come from one pass, as in
`speculators/fasteagle.py`.

- `update_fasteagle` is the speculators-format updater (vLLM's `SUPPORTED_SPECULATORS_TYPES`): the draft config of
  the architecture `FastEagleLlamaForCausalLM`, with an out-of-vocabulary parallel-slot token (`pard_token` =
  vocab_size: FastEagle never reads those slots' token, and no real token can be taken for one);
- `with_fasteagle_method` makes `vllm serve FASTEAGLE_DIR` (the checkpoint as the model) read
  `method: "fasteagle"` as eagle3 with parallel drafting, as vLLM does for "peagle";
- `with_fasteagle_model` adds the architecture to vLLM's model registry (lazily, by module name).
"""
from __future__ import annotations

from typing import Any, Callable

ARCHITECTURE = "FastEagleLlamaForCausalLM"
MODEL_CLASS = "hybridspec.vllm_plugin.fasteagle_model:FastEagleLlamaForCausalLM"
SPECULATORS_TYPE = "fasteagle"


def update_fasteagle(config_dict: dict, pre_trained_config: dict) -> None:
    """vLLM's speculators-config updater for "fasteagle" (the fields of vLLM's `update_peagle`, without
    mask_token_id / mask_hidden, which FastEagle has not)."""
    model_type = pre_trained_config.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"unsupported model_type {model_type!r} for a FastEagle speculator (llama only)")
    if config_dict.get("independent_layers"):
        raise ValueError("this FastEagle checkpoint has independent_layers: true (the no-cascade ablation): only "
                         "cascades run in vLLM; hybridspec's Engine runs it (speculate='fasteagle')")
    pre_trained_config["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    if config_dict.get("target_hidden_size") is not None:
        pre_trained_config["target_hidden_size"] = config_dict["target_hidden_size"]
    pre_trained_config["norm_before_residual"] = config_dict.get("norm_before_residual", False)
    pre_trained_config["norm_before_fc"] = False
    pre_trained_config["architectures"] = [ARCHITECTURE]
    pre_trained_config["pard_token"] = int(pre_trained_config["vocab_size"])  # out of the vocabulary
    if config_dict.get("eagle_aux_hidden_state_layer_ids"):
        pre_trained_config["eagle_aux_hidden_state_layer_ids"] = config_dict["eagle_aux_hidden_state_layer_ids"]


def with_fasteagle_type(original: dict) -> dict:
    """vLLM's table of speculators types with "fasteagle" added (a copy: the original is restored as it was)."""
    return {**original, SPECULATORS_TYPE: update_fasteagle}


def with_fasteagle_method(original: Callable[..., dict]) -> Any:
    """`SpeculatorsConfig.build_vllm_speculative_config` that reads method "fasteagle" as eagle3 with parallel
    drafting (vLLM's own reading of "peagle")."""
    def build_vllm_speculative_config(cls: Any, config_dict: dict) -> dict:
        result = original(config_dict=config_dict)
        if result.get("method") == SPECULATORS_TYPE:
            result.update({"method": "eagle3", "parallel_drafting": True})
        return result

    build_vllm_speculative_config.__wrapped__ = original
    return classmethod(build_vllm_speculative_config)


def with_fasteagle_model(original: dict) -> dict:
    """vLLM's registered architectures with FastEagle's added lazily (a copy, by vLLM's own `register_model` on a
    scratch registry, so that restoring the original dict removes it again)."""
    from vllm.model_executor.models.registry import ModelRegistry

    scratch = type(ModelRegistry)(dict(original))
    scratch.register_model(ARCHITECTURE, MODEL_CLASS)
    return scratch.models
