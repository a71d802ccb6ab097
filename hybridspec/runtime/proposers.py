"""Turning a `speculate=` name into a proposer: the engine's suffix cache, n-gram proposer, model drafters (loaded on
first use and checked against the target) and suffix + drafter hybrids, each made once per engine."""
from __future__ import annotations

import contextlib
import copy
import os
import threading
from importlib import resources
from importlib.abc import Traversable
from typing import Any, Callable, ContextManager, Mapping

import torch

from hybridspec.errors import InvalidParameter, InvalidParameterType
from hybridspec.model.calibration import machine_draft_cost
from hybridspec.model.linear import fast_bf16, pack_linears
from hybridspec.model.target import TargetModel
from hybridspec.proposal import FeatureProposer, Proposer, check_proposer
from hybridspec.router import DraftCost, HybridProposer, Router
from hybridspec.speculators import Drafter, DrafterProposer, load_drafter
from hybridspec.speculators.proposer import DEFAULT_DRAFTER_CONTEXT
from hybridspec.speculators.registry import DRAFTER_KINDS

HYBRID_KINDS = tuple(f"suffix+{kind}" for kind in DRAFTER_KINDS)
SPECULATE_CHOICES = ("suffix", "ngram", *DRAFTER_KINDS, *HYBRID_KINDS, "none")


def shipped_checkpoint(kind: str) -> Traversable:
    """The head of `kind` shipped for SmolLM2-135M-Instruct, as package data of `hybridspec.speculators`: found the same
    in a checkout, an editable install and an installed wheel."""
    return resources.files("hybridspec.speculators") / "checkpoints" / f"{kind}-smollm2"


class Proposers:
    """The proposers of one engine, by `speculate=` name, made on first use and shared by every call.

    drafters: checkpoint directories (or `Drafter` modules) by drafter kind; by default the heads shipped for
    SmolLM2-135M-Instruct. drafter_bf16: run drafters' matrix products in bfloat16 on the CPU (default: where the CPU
    does bfloat16 natively). drafter_context: the positions a drafter reads at most (`DrafterProposer`'s). A
    hybrid runs its drafter where the router's rates say it pays, and picks between the two drafts by the router's
    calibrated `expected_tokens`; what a draft costs is this machine's (`calibration.machine_draft_cost`) with
    measure_draft_cost, else the built-in table of its kind (`router.cost.DEFAULT_DRAFT_MS`).
    """

    def __init__(self, target: TargetModel, router: Router, num_speculative_tokens: int, suffix_cache: Any = None,
                 drafters: Mapping[str, str | os.PathLike | Any] | None = None, drafter_bf16: bool | None = None,
                 drafter_context: int = DEFAULT_DRAFTER_CONTEXT, measure_draft_cost: bool = False):
        unknown = set(drafters or ()) - set(DRAFTER_KINDS)
        if unknown:
            raise ValueError(f"drafters: unknown kind(s) {sorted(unknown)}; the kinds are {DRAFTER_KINDS}")
        self.target, self.router = target, router
        self.num_speculative_tokens = num_speculative_tokens
        self.drafters: dict[str, Any] = dict(drafters or {})
        self.drafter_bf16 = fast_bf16() if drafter_bf16 is None else drafter_bf16
        self.drafter_context = drafter_context
        self.measure_draft_cost = measure_draft_cost
        self._suffix_cache = suffix_cache
        self._made: dict[str, Proposer | FeatureProposer] = {}
        self._making = threading.RLock()  # callers of several threads may ask for the same new one
        # what a proposer is made under: its engine's loop held between steps (`EngineLoop.paused`)
        self.exclusive: Callable[[], ContextManager[None]] = contextlib.nullcontext

    def get(self, speculate: str | Proposer | FeatureProposer | None) -> Proposer | FeatureProposer | None:
        """The proposer for a `speculate=` value: a name of SPECULATE_CHOICES, None / "none" (no speculation) or a
        proposer of the caller's (checked against the contract). An `InvalidParameter` ("speculate") says why not."""
        if speculate is None or speculate == "none":
            return None
        if not isinstance(speculate, str):
            try:
                return check_proposer(speculate)
            except TypeError as e:
                raise InvalidParameterType(str(e), "speculate") from None
        if speculate not in SPECULATE_CHOICES:
            raise InvalidParameter(f"speculate must be one of {SPECULATE_CHOICES} or a Proposer, got {speculate!r}",
                                   "speculate")
        if speculate == "suffix":
            return self.suffix_cache
        if speculate not in self._made:
            with self._making, self.exclusive():
                if speculate not in self._made:
                    self._made[speculate] = self._make(speculate)
        return self._made[speculate]

    @property
    def suffix_cache(self):
        """The engine's suffix cache: prompts of live requests and every finished response (shared by all calls)."""
        if self._suffix_cache is None:
            from hybridspec.suffix import SuffixCache

            with self._making:
                if self._suffix_cache is None:
                    self._suffix_cache = SuffixCache(num_speculative_tokens=self.num_speculative_tokens,
                                                     vocab_size=self.target.vocab_size)
        return self._suffix_cache

    def _make(self, speculate: str) -> Proposer | FeatureProposer:
        if speculate == "ngram":
            from hybridspec.suffix import NgramProposer

            return NgramProposer(num_speculative_tokens=self.num_speculative_tokens)
        if speculate in HYBRID_KINDS:
            kind = speculate.split("+")[1]
            drafter = self.get(kind)
            cost = DraftCost(machine_draft_cost(drafter.drafter, self.target)) if self.measure_draft_cost else kind
            return HybridProposer(self.suffix_cache, drafter, self.router,
                                  num_speculative_tokens=self.num_speculative_tokens, draft_cost=cost)
        return DrafterProposer(self.load_drafter(speculate), drafter_context=self.drafter_context)

    def load_drafter(self, kind: str) -> Drafter:
        """The drafter of `kind` on the target's device, checked against the target (packed for the CPU); one that
        does not fit the target is an `InvalidParameter` ("speculate": the call asked for it)."""
        source = self.drafters.get(kind) or shipped_checkpoint(kind)
        target = self.target
        try:
            if isinstance(source, Drafter):
                source.check_target(target.config, target.aux_layer_ids)
                drafter = copy.deepcopy(source).to(target.device).eval()  # packing below must not touch theirs
            else:
                drafter = load_drafter(source, target=target.config, embed_tokens=target.embed,
                                       aux_layer_ids=target.aux_layer_ids, device=target.device)
        except ValueError as e:
            hint = "" if kind in self.drafters else (
                f" (the shipped {kind} head is for SmolLM2-135M-Instruct: train one for this target with "
                f"`hybridspec train` and pass Engine(..., drafters={{{kind!r}: PATH}}))")
            raise InvalidParameter(f"{e}{hint}", "speculate") from e
        if target.device.type == "cpu":
            # A drafter's numbers only choose what to verify, never what is output: bfloat16 is lossless here.
            pack_linears(drafter, torch.bfloat16 if self.drafter_bf16 else None)
        return drafter
