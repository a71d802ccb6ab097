"""What a drafter reads of its target: the target's features, the facts a checkpoint must agree with, and the draft
vocabulary.

Drafters never import the runtime: the engine (or the training pipeline) passes the target's hidden states in as
`TargetFeatures`, and the target's input embedding as a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 convention (vLLM's default too): the inputs of layers 2, L//2 and L-3."""
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 layers for EAGLE-style auxiliary hidden states, got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class TargetFeatures:
    """What a drafter needs from the target at n consecutive positions of one sequence.

    aux:   [n, len(aux_layer_ids) * H] the target's hidden states at the *inputs* of the drafter's aux layers,
           concatenated in layer-id order (HF `output_hidden_states[i]` is the input of layer i).
    final: [n, H] the target's final hidden state, after its final norm (what the target's lm_head reads).
    Row i belongs to the position whose output was the token that follows it (see `Drafter`).
    """

    aux: Tensor
    final: Tensor

    def __post_init__(self) -> None:
        if self.aux.dim() != 2 or self.final.dim() != 2 or self.aux.shape[0] != self.final.shape[0]:
            raise ValueError(f"TargetFeatures needs aux [n, kH] and final [n, H] with the same n, "
                             f"got {tuple(self.aux.shape)} and {tuple(self.final.shape)}")

    def __len__(self) -> int:
        return self.aux.shape[0]

    def __getitem__(self, index: slice) -> "TargetFeatures":
        return TargetFeatures(self.aux[index], self.final[index])

    @classmethod
    def from_hidden_states(cls, hidden_states: Sequence[Tensor], aux_layer_ids: Sequence[int]) -> "TargetFeatures":
        """From a Hugging Face `output_hidden_states` tuple (L+1 tensors, [T, H] or [1, T, H]) of one sequence."""
        num_layers = len(hidden_states) - 1
        bad = [i for i in aux_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside the target's {num_layers} layers")
        squeeze = (lambda t: t[0]) if hidden_states[0].dim() == 3 else (lambda t: t)
        aux = torch.cat([squeeze(hidden_states[i]) for i in aux_layer_ids], dim=-1)
        return cls(aux=aux, final=squeeze(hidden_states[-1]))

    @staticmethod
    def cat(parts: Sequence["TargetFeatures"]) -> "TargetFeatures":
        return TargetFeatures(torch.cat([p.aux for p in parts]), torch.cat([p.final for p in parts]))


@dataclass(frozen=True)
class TargetInfo:
    """The facts about a target that a drafter checkpoint must agree with."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: Any) -> "TargetInfo":
        """From a TargetInfo or anything shaped like a Hugging Face config (num_hidden_layers, hidden_size,
        vocab_size)."""
        if isinstance(config, TargetInfo):
            return config
        text = getattr(config, "get_text_config", None)
        config = text() if callable(text) else config
        return cls(int(config.num_hidden_layers), int(config.hidden_size), int(config.vocab_size))


def check_target(kind: str, *, target: TargetInfo, hidden_size: int, vocab_size: int,
                 aux_layer_ids: Sequence[int] = (), expected_aux_layer_ids: Sequence[int] | None = None) -> None:
    """Raise a ValueError naming every mismatch between a drafter and the target it is about to serve.

    Wrong auxiliary layer ids do not crash anything: they silently collapse acceptance, so they are checked here.
    """
    problems = []
    if hidden_size != target.hidden_size:
        problems.append(f"target hidden size {target.hidden_size} != drafter's target_hidden_size {hidden_size}")
    if vocab_size != target.vocab_size:
        problems.append(f"target vocabulary {target.vocab_size} != drafter's target vocabulary {vocab_size}")
    out_of_range = [i for i in aux_layer_ids if not 0 <= i < target.num_layers]
    if out_of_range:
        problems.append(f"aux layer ids {list(aux_layer_ids)} do not fit the target's {target.num_layers} layers")
    if expected_aux_layer_ids is not None and list(expected_aux_layer_ids) != list(aux_layer_ids):
        problems.append(f"the runtime captures layers {list(expected_aux_layer_ids)} but the drafter was trained on "
                        f"{list(aux_layer_ids)}")
    if problems:
        raise ValueError(f"{kind} drafter does not match its target: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------------------------------
# Draft vocabulary


def build_draft_vocab(token_counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent target tokens.

    Draft ids are ordered by target id, d2t is the offset table of the speculators format (target id = i + d2t[i]),
    t2d a boolean mask over the target vocabulary.
    """
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    # Ties broken by target id, so the same counts always give the same vocabulary.
    order = torch.argsort(token_counts.double() - torch.arange(vocab, dtype=torch.float64) / (2 * vocab),
                          descending=True)
    target_ids = torch.sort(order[:draft_vocab_size]).values
    d2t = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t.long(), t2d
