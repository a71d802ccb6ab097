"""Chain attention for training (P-EAGLE's parallel groups, EAGLE-3's training-time test): where the training elements
of a packed batch sit, which chains are sampled, and attention over a sequence's real slots plus a chain's own
elements.

Lives beside the drafters rather than in .train because `EagleBase.chain_logits` (the training computation, on the
model) uses it, and .train imports the drafters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hybridspec.speculators.layers import Attention


@dataclass
class ChainLayout:
    """Where the training elements of a packed batch sit.

    Depth 0 is every real slot i (target hidden state of position i, the token after it). Depth d >= 1 holds a subset of
    origins (nested: depth d's origins are among depth d-1's), at position pos[i] + d, one step further down the chain
    from origin i. Element (i, d) attends to real slots j <= i of its own sequence and to (i, 1..d) of its own chain.
    """

    seq_id: Tensor            # [N] sequence of each real slot
    positions: Tensor         # [N] position of each real slot within its sequence
    origins: list[Tensor]     # origins[d]: [n_d] real-slot indices of depth d's elements (sorted; the EAGLE family
                              # needs every real slot at depth 0 as context, the LSTM may start from fewer)
    rank_in_depth: list[Tensor] = field(init=False)  # rank_in_depth[d][i]: index of origin i in depth d (-1: absent)

    def __post_init__(self) -> None:
        n = self.seq_id.numel()
        self.rank_in_depth = []
        for idx in self.origins:
            rank = torch.full((n,), -1, dtype=torch.long, device=idx.device)
            rank[idx] = torch.arange(idx.numel(), device=idx.device)
            self.rank_in_depth.append(rank)

    def prefix_mask(self, depth: int) -> Tensor:
        """[n_d, N]: element (i, depth) sees real slot j iff same sequence and j <= i."""
        origin = self.origins[depth]
        j = torch.arange(self.seq_id.numel(), device=self.seq_id.device)
        return (self.seq_id[origin][:, None] == self.seq_id[None, :]) & (j[None, :] <= origin[:, None])

    def element_positions(self, depth: int) -> Tensor:
        return self.positions[self.origins[depth]] + depth

    def to(self, device: torch.device | str) -> "ChainLayout":
        """The same layout on another device (built on the CPU, where its chains are sampled)."""
        return ChainLayout(self.seq_id.to(device), self.positions.to(device), [o.to(device) for o in self.origins])


def sample_chain_origins(valid_depth: Tensor, max_depth: int, keep_ratio: float = 0.7, min_ratio: float = 0.2,
                         generator: torch.Generator | None = None, first: Tensor | None = None) -> list[Tensor]:
    """P-EAGLE's per-depth sampling: depth 0 keeps every real slot (or the slots `first`); depth d keeps about
    n * max(keep_ratio^d, min_ratio) origins, drawn from depth d-1's (so every kept chain is complete) among those
    whose chain reaches depth d.

    valid_depth[i]: how deep the chain from real slot i can go (its target exists up to there).
    """
    origins = [torch.arange(valid_depth.numel()) if first is None else first]
    n = origins[0].numel()
    for d in range(1, max_depth):
        previous = origins[-1]
        candidates = previous[valid_depth[previous] >= d]
        want = min(candidates.numel(), max(1, round(n * max(keep_ratio ** d, min_ratio))))
        if want == 0:
            break
        pick = torch.randperm(candidates.numel(), generator=generator)[:want]
        origins.append(torch.sort(candidates[pick]).values)
    return origins


def full_chain_origins(valid_depth: Tensor, max_depth: int, first: Tensor | None = None) -> list[Tensor]:
    """Every chain (from every real slot, or from the slots `first`) to every depth it reaches (evaluation, EAGLE-3's
    training-time test)."""
    origins = [torch.arange(valid_depth.numel()) if first is None else first]
    for d in range(1, max_depth):
        idx = origins[0][valid_depth[origins[0]] >= d]
        if idx.numel() == 0:
            break
        origins.append(idx)
    return origins


def chain_attention(attn: Attention, q: Tensor, layout: ChainLayout, depth: int, keys: list[Tensor],
                    values: list[Tensor], prefix_mask: Tensor) -> Tensor:
    """Attention of depth `depth`'s queries q [heads, n_d, d] over the real slots (keys[0]) and their own chain
    (keys[1..depth], one key per element; each keys[e] is [kv_heads, n_e, d]). Returns [heads, n_d, d].

    Costs O(n_d * (N + depth)) instead of the O((sum n_d)^2) of one dense mask over every element.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = attn.expand_kv(keys[0]), attn.expand_kv(values[0])
    scores = [torch.matmul(q, k0.transpose(1, 2)).masked_fill(~prefix_mask, float("-inf"))]
    chain_values = []
    for e in range(1, depth + 1):
        rows = layout.rank_in_depth[e][layout.origins[depth]]  # this chain's element at depth e
        ke, ve = attn.expand_kv(keys[e][:, rows]), attn.expand_kv(values[e][:, rows])
        scores.append((q * ke).sum(-1, keepdim=True))
        chain_values.append(ve)
    probs = torch.softmax(torch.cat(scores, dim=-1) * scale, dim=-1)
    out = torch.matmul(probs[..., : k0.shape[1]], v0)
    for e, ve in enumerate(chain_values):
        out = out + probs[..., k0.shape[1] + e: k0.shape[1] + e + 1] * ve
    return out
