"""The drafter kinds, in one table: a kind's name ("peagle", "lstm", "eagle3", "fasteagle") -> its model class, its
config class and the checkpoint format it is saved in. The engine, the training recipe and trainer, and the checkpoint
formats read their kinds from here, so a new drafter is added in one place."""
from __future__ import annotations

from dataclasses import dataclass

from hybridspec.speculators.drafter import Drafter
from hybridspec.speculators.eagle import EagleConfig
from hybridspec.speculators.eagle3 import Eagle3Drafter
from hybridspec.speculators.fasteagle import FastEagleDrafter
from hybridspec.speculators.lstm import LSTMConfig, LSTMDrafter
from hybridspec.speculators.peagle import PEagleDrafter

SPECULATORS_FORMAT = "speculators"  # vllm-project/speculators (vLLM's SpeculatorsConfig): P-EAGLE, EAGLE-3, FastEagle
ARCTIC_FORMAT = "arctic"            # ArcticTraining's LSTM speculator (ArcticInference reads it)


@dataclass(frozen=True)
class DrafterKind:
    name: str
    drafter: type[Drafter]
    config: type              # the class of the drafter's config (its constructor's first argument)
    checkpoint_format: str    # SPECULATORS_FORMAT or ARCTIC_FORMAT
    architecture: str         # the "architectures" entry of its checkpoint's config.json

    def __post_init__(self) -> None:
        if self.drafter.name != self.name:
            raise ValueError(f"drafter kind {self.name!r} maps to {self.drafter.__name__}, named {self.drafter.name!r}")


# The order is the engine's (its speculate choices list the kinds in it).
DRAFTERS: dict[str, DrafterKind] = {kind.name: kind for kind in (
    DrafterKind("peagle", PEagleDrafter, EagleConfig, SPECULATORS_FORMAT, "PEagleSpeculator"),
    DrafterKind("lstm", LSTMDrafter, LSTMConfig, ARCTIC_FORMAT, "ArcticLSTMSpeculatorPreTrainedModel"),
    DrafterKind("eagle3", Eagle3Drafter, EagleConfig, SPECULATORS_FORMAT, "Eagle3Speculator"),
    DrafterKind("fasteagle", FastEagleDrafter, EagleConfig, SPECULATORS_FORMAT, "FastEagleSpeculator"),
)}
DRAFTER_KINDS: tuple[str, ...] = tuple(DRAFTERS)


def drafter_kind(name: str) -> DrafterKind:
    """The kind named `name`; a ValueError naming the kinds otherwise."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {name!r}; the kinds are {DRAFTER_KINDS}")
    return DRAFTERS[name]


def kinds_in_format(checkpoint_format: str) -> dict[str, DrafterKind]:
    """The kinds saved in `checkpoint_format`, by name."""
    return {name: kind for name, kind in DRAFTERS.items() if kind.checkpoint_format == checkpoint_format}
