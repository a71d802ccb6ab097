"""hybridspec inside vLLM: our suffix cache as vLLM's `method: "suffix"`, and the suffix + P-EAGLE hybrid as its
`method: "eagle3"` (or `"eagle"`), switched on by one environment variable.

    HYBRIDSPEC_VLLM=suffix         vLLM's "suffix" method drafts from hybridspec's SuffixCache (no ArcticInference)
    HYBRIDSPEC_VLLM=hybrid         vLLM's "eagle3"/"eagle" method: the EAGLE head drafts every row, and per row the
                                   router (router/hybrid.py `choose_draft`, the engine's rule) keeps it or the
                                   suffix draft
    HYBRIDSPEC_VLLM=fasteagle      FastEagle heads (speculators type "fasteagle") run as vLLM's "eagle3" with
                                   parallel drafting: all K drafts from one pass of the cascade (`fasteagle`,
                                   `fasteagle_model`); with "hybrid" too, the hybrid drafts with them
    HYBRIDSPEC_VLLM=suffix,hybrid  several, comma-separated
    unset, "" or "0"               the plugin does nothing: installing hybridspec changes no vLLM that did not ask

vLLM loads `register()` (the `vllm.general_plugins` entry point) in every process: the front end, the engine core and
each worker; the variable is inherited by spawned workers. vLLM has no proposer registry (0.33 neither) and its
`custom_class` method sees no request ids and no hidden states, so `register()` applies the patches of `PATCHES`: each
target is checked to exist first, all are applied or none (a failure restores what was patched, logs one error and
leaves vLLM as it was), and each is logged. None of their targets is public API: each patch names the vLLM series it is
written for (SUPPORTED_VLLM_SERIES, 0.32.x and 0.33.x; the V1 model runner's interfaces the proposers use are the same
in both), and any other version is refused with a message naming the range, vLLM untouched. vLLM 0.33 runs most
speculative methods on its V2 model runner (MRV2), which has no place for a proposer of ours: there the plugin keeps a
config that asks for the hybrid on the V1 runner, as 0.33 itself does for `suffix` and parallel drafting
(`_keep_v1_runner`). The proposers themselves are in `proposers`, the request life cycle they share in `requests`, the
switches in `config`.

Per request the suffix cache is driven as hybridspec's Engine drives it: `start_request` with the prompt the first time
the request has a sampled token, `append` of the tokens each step committed (cut by the engine's commit rules,
`hybridspec.runtime.commit`), `speculate`, and `finish_request` when vLLM finishes it normally (a stop token,
max_tokens, the
model's length) or `abort_request` otherwise (an abort, a stop string the front end caught, a preemption: a request
that leaves the batch is forgotten, and restarted with its prompt and output so far when it returns).

HYBRIDSPEC_VLLM_VERIFY_COST also plans each step's drafts with the engine's CostGate, as the engine's router does:
"measure" (its tables refitted to the passes vLLM runs), "default" (the built-in tables) or a verify-cost JSON; unset,
vLLM verifies every draft in full. HYBRIDSPEC_VLLM_OBSERVER ("module:Class") hands
every life-cycle event to an observer (the tests record them with it).

Nothing heavy is imported here at module level: vLLM and torch only inside `register()` and `proposers`.
"""
from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hybridspec.vllm_plugin.config import (ENV_SWITCH, HYBRID_METHODS, SUPPORTED_VLLM_RANGE, SUPPORTED_VLLM_SERIES,
                                           PluginError, check_vllm_version, logger, requested_modes)

__all__ = ["register", "requested_modes", "check_vllm_version", "PluginError", "SUPPORTED_VLLM_SERIES",
           "SUPPORTED_VLLM_RANGE", "Patch", "PATCHES", "apply_patches", "restore_patches"]

_lock = threading.Lock()
_applied: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) of every patch in force


@dataclass(frozen=True)
class Patch:
    """Replace `attribute` of `target` ("module" or "module:Class") by `replacement(original)`, for `mode` (None:
    whenever the plugin is on) on the vLLM `series` named (empty: every supported one)."""

    target: str
    attribute: str
    replacement: Callable[[Any], Any]
    mode: str | None = None
    why: str = ""
    series: tuple[str, ...] = ()

    def owner(self) -> Any:
        module, _, qualname = self.target.partition(":")
        owner = importlib.import_module(module)
        for name in filter(None, qualname.split(".")):
            owner = getattr(owner, name)
        return owner


def _suffix_proposer(original: Any) -> Any:
    from hybridspec.vllm_plugin.proposers import HybridspecSuffixProposer

    return HybridspecSuffixProposer


def _hybrid_proposer(original: Any) -> Any:
    from hybridspec.vllm_plugin.proposers import HybridspecHybridProposer

    return HybridspecHybridProposer


def _fasteagle(name: str) -> Callable[[Any], Any]:
    def replacement(original: Any) -> Any:
        from hybridspec.vllm_plugin import fasteagle

        return getattr(fasteagle, name)(original)

    return replacement


def _wrap_update_states(original: Callable) -> Callable:
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        # `drafter` exists only with a speculative config, and may be vLLM's own proposer (another method)
        requests = getattr(getattr(self, "drafter", None), "hybridspec_requests", None)
        if requests is not None:  # before vLLM forgets the finished requests' states
            requests.runner_requests = self.requests
            requests.on_scheduler_output(scheduler_output, self.requests)
        return original(self, scheduler_output)

    _update_states.__wrapped__ = original
    return _update_states


def _keep_v1_runner(original: property) -> property:
    def use_v2_model_runner(self: Any) -> bool:
        v2, spec = original.fget(self), self.speculative_config
        if not v2 or spec is None or spec.method not in HYBRID_METHODS:
            return v2
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").strip() not in ("", "0"):  # as vllm.envs reads it
            raise PluginError(f"{ENV_SWITCH}=hybrid runs on vLLM's V1 model runner, and VLLM_USE_V2_MODEL_RUNNER=1 "
                              f"asks for the V2 one (it has no place for hybridspec's proposer); unset one of them")
        logger.info("hybridspec: the hybrid keeps speculative method %r on vLLM's V1 model runner", spec.method)
        return False

    return property(use_v2_model_runner)


def _keep_prefix_hits(original: Callable) -> Callable:
    def use_eagle_block_drop(self: Any) -> bool:
        # vLLM drops the last block of an EAGLE request's prefix-cache hit because the drafter's KV at the block's
        # end was built with whatever token followed it then. That only worsens a draft, and the hybrid's drafts
        # are verified: keeping the block saves re-prefilling it (128 tokens on CPU) on every resent agent prompt.
        return False if self.method in HYBRID_METHODS else original(self)

    use_eagle_block_drop.__wrapped__ = original
    return use_eagle_block_drop


RUNNER = "vllm.v1.worker.gpu_model_runner"
SPECULATORS = "vllm.transformers_utils.configs.speculators.base"
PATCHES: tuple[Patch, ...] = (
    Patch(f"{RUNNER}:GPUModelRunner", "_update_states", _wrap_update_states,
          why="learn which requests finished before vLLM drops their state"),
    Patch(RUNNER, "SuffixDecodingProposer", _suffix_proposer, "suffix",
          why="method 'suffix' drafts from hybridspec's SuffixCache (the runner checks its drafter with isinstance: "
              "the replacement subclasses it)"),
    Patch("vllm.config.speculative", "has_arctic_inference", lambda original: lambda: True, "suffix",
          why="config validation asks for ArcticInference when method == 'suffix'; ours needs none"),
    Patch(RUNNER, "EagleProposer", _hybrid_proposer, "hybrid",
          why="methods 'eagle'/'eagle3' become the suffix + EAGLE hybrid"),
    Patch(SPECULATORS, "SUPPORTED_SPECULATORS_TYPES", _fasteagle("with_fasteagle_type"), "fasteagle",
          why="speculators checkpoints of type 'fasteagle' are read (as the architecture FastEagleLlamaForCausalLM)"),
    Patch(f"{SPECULATORS}:SpeculatorsConfig", "build_vllm_speculative_config", _fasteagle("with_fasteagle_method"),
          "fasteagle", why="a FastEagle checkpoint served as the model runs as eagle3 with parallel drafting"),
    Patch("vllm.model_executor.models.registry:ModelRegistry", "models", _fasteagle("with_fasteagle_model"),
          "fasteagle", why="the FastEagle cascade's model class (hybridspec.vllm_plugin.fasteagle_model)"),
    Patch("vllm.config.speculative:SpeculativeConfig", "use_eagle_block_drop", _keep_prefix_hits, "hybrid",
          why="a resent prompt keeps its whole prefix-cache hit under the hybrid (vLLM's EAGLE drops the last block "
              "for its drafter's sake; the hybrid verifies every draft)"),
    Patch("vllm.config.vllm:VllmConfig", "use_v2_model_runner", _keep_v1_runner, "hybrid", series=("0.33",),
          why="eagle/eagle3 with the hybrid stay on the V1 runner, where the hybrid's proposer is (MRV2 would run "
              "plain EAGLE)"),
)


def apply_patches(patches: Sequence[Patch], modes: frozenset[str], series: str) -> bool:
    """Apply every patch for `modes` on vLLM `series`, all or nothing: each target and attribute is checked first,
    and a failure restores what was already patched and logs one error (vLLM then runs unchanged). Returns whether
    they apply."""
    wanted = [p for p in patches if (p.mode is None or p.mode in modes) and (not p.series or series in p.series)]
    done: list[tuple[Any, str, Any]] = []
    try:
        owners = [p.owner() for p in wanted]
        missing = [f"{p.target}.{p.attribute}" for p, o in zip(wanted, owners) if not hasattr(o, p.attribute)]
        if missing:
            raise AttributeError(f"not found: {', '.join(missing)}")
        for patch, owner in zip(wanted, owners):
            original = getattr(owner, patch.attribute)
            replacement = patch.replacement(original)
            setattr(owner, patch.attribute, replacement)
            done.append((owner, patch.attribute, original))
    except Exception as e:  # noqa: BLE001 - whatever failed, vLLM must be left as it was
        for owner, attribute, original in reversed(done):
            setattr(owner, attribute, original)
        logger.error("hybridspec: could not patch vLLM (%s: %s); nothing was changed, vLLM runs without hybridspec",
                     type(e).__name__, e)
        return False
    _applied.extend(done)
    for patch in wanted:
        why = f" ({patch.why})" if patch.why else ""
        logger.info("hybridspec: patched %s.%s%s", patch.target, patch.attribute, why)
    return True


def restore_patches() -> None:
    """Undo every patch in force (tests; a process that wants vLLM back as it was)."""
    with _lock:
        while _applied:
            owner, attribute, original = _applied.pop()
            setattr(owner, attribute, original)


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent, a no-op unless HYBRIDSPEC_VLLM asks for a mode."""
    modes = requested_modes()
    if not modes:
        return
    with _lock:
        if _applied:
            return
        import vllm

        series = check_vllm_version(vllm.__version__)
        try:
            import numpy  # noqa: F401

            from hybridspec.router import CostGate, choose_draft  # noqa: F401
            from hybridspec.suffix import SuffixCache  # noqa: F401  (the compiled suffix tree)
        except ImportError as e:
            raise PluginError(f"{ENV_SWITCH} is set but hybridspec cannot load ({e}); install it into vLLM's "
                              f"environment with `pip install \"hybridspec[vllm]\"` (from a checkout: "
                              f"scripts/setup_vllm.sh), or unset {ENV_SWITCH}") from None
        apply_patches(PATCHES, modes, series)
