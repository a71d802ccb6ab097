"""Training batches: the real slots of several sequences of a feature store packed together, and a drafter's logits
for the chains laid over them.

Slot j of a sequence x_0..x_{T-1} is the target's features at position j with the token x_{j+1} that followed; the
chain element (j, d) predicts x_{j+d+2}, whose target distribution is the target's output at position j+d+1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hybridspec.speculators.chains import ChainLayout
from hybridspec.speculators.eagle import EagleBase
from hybridspec.speculators.train.data import FeatureStore


@dataclass
class Batch:
    """Real slots of several sequences packed together (one row per slot)."""

    aux: Tensor           # [N, kH] target aux hidden states
    final: Tensor         # [N, H] target final hidden state
    next_tokens: Tensor   # [N] the token after the slot's position
    target_final: Tensor  # [N, H] target final hidden state one position later (its distribution is the slot's target)
    target_top1: Tensor   # [N] the target's greedy token for the slot's target
    loss_mask: Tensor     # [N] the slot's target token is inside the response
    is_origin: Tensor     # [N] drafting starts here at inference (the committed token is a response token)
    seq_id: Tensor        # [N]
    positions: Tensor     # [N]
    valid_depth: Tensor   # [N] deepest chain element whose target exists in the same sequence

    def __len__(self) -> int:
        return self.next_tokens.numel()

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(**{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})


def first_slot(span: tuple[int, int, int], max_slots: int, max_prompt_slots: int | None = None) -> int:
    """The first slot a batch keeps of a sequence (start, end, response start): at most its last max_slots slots (the
    response end), and at most max_prompt_slots slots before the first trained-on one (prompt context)."""
    start, end, rs = span
    first = max(0, end - start - 2 - max_slots)
    return first if max_prompt_slots is None else max(first, rs - 2 - max_prompt_slots)


def make_batch(store: FeatureStore, seq_indices: list[int], max_slots: int, max_depth: int,
               max_prompt_slots: int | None = None) -> Batch:
    """Pack sequences, each cut to the slots `first_slot` keeps."""
    rows, seq_ids, positions, loss, origin, depth = [], [], [], [], [], []
    for b, index in enumerate(seq_indices):
        start, end, rs = store.spans[index]
        n = end - start - 2  # slots 0..T-3: each has a target token inside the sequence
        first = first_slot(store.spans[index], max_slots, max_prompt_slots)
        if n - first <= 0:
            continue
        j = torch.arange(first, n)
        rows.append(start + j)
        seq_ids.append(torch.full_like(j, b))
        positions.append(j)
        loss.append(j + 2 >= rs)
        origin.append(j + 1 >= rs)
        depth.append(torch.clamp(n - 1 - j, max=max_depth - 1))
    g = torch.cat(rows)
    data = store.data
    return Batch(aux=data["aux"][g].float(), final=data["final"][g].float(), next_tokens=data["tokens"][g + 1].long(),
                 target_final=data["final"][g + 1].float(), target_top1=data["topk_ids"][g + 1, 0].long(),
                 loss_mask=torch.cat(loss), is_origin=torch.cat(origin), seq_id=torch.cat(seq_ids),
                 positions=torch.cat(positions), valid_depth=torch.cat(depth))


def chain_logits(drafter: Any, batch: Batch, layout: ChainLayout) -> list[Tensor]:
    """The drafter's logits for every chain element of `layout` (EAGLE family: aux features, LSTM: final)."""
    inputs = batch.aux if isinstance(drafter, EagleBase) else batch.final
    return drafter.chain_logits(inputs, batch.next_tokens, layout)
