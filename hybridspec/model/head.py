"""The output layer of a greedy step. Greedy verification needs only each row's argmax of the logits, so for a small
pass `GreedyHead` multiplies in bfloat16 (half the bytes of the float32 output layer, which is a fifth of a small
model's weights and a decode step reads every weight once) and recomputes in float32 only the logits of the tokens
that could still be the maximum under bfloat16's error bound: its argmax is exactly the float32 one.
"""
from __future__ import annotations

import torch

from hybridspec.model.linear import Linear


class GreedyHead:
    """The output layer of a greedy step, whose logits matter only where they are a row's maximum: the product in
    bfloat16, then exact float32 logits for every token that could be the maximum.

    Why: a decode step reads every weight once, and the output layer is a fifth of SmolLM2's bytes; in bfloat16 it is
    half as many. Exact: a bfloat16 logit differs from the float32 one by at most err_i = C |h| |w_i| (C covers the
    roundings of h, w_i and the output to bfloat16 and the float32 accumulation; |h| |w_i| bounds sum_j |h_j w_ij|),
    so the float32 argmax is among the tokens whose bfloat16 logit + err_i reaches the row's bfloat16 maximum less its
    error (on SmolLM2, a few dozen). Those logits are recomputed in float32; the rest stay below the maximum.
    """

    MAX_ROWS = 4  # beyond: no faster than the float32 product on this CPU (plain steps gain 3-7%; bench_verify_cost)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [V, H] float32, the model's own (no copy)
        self.bf16 = Linear(weight, compute_dtype=torch.bfloat16)
        self.row_norms = weight.norm(dim=-1)
        # |bf16 logit - logit| <= C |h| |w_i|: three bfloat16 roundings (unit roundoff u = 2^-8: 3u + 3u^2 + u^3) and
        # a float32 sum of H products (H 2^-24); all but the first-order term doubled for margin
        u = 2.0 ** -8
        self.C = 3 * u + 2 * (3 * u * u + u ** 3 + weight.shape[1] * 2.0 ** -24)
        self.bit_shifts = torch.arange(32, dtype=torch.int32, device=weight.device)

    def __call__(self, hidden: torch.Tensor, token_masks: torch.Tensor | None = None) -> torch.Tensor:
        """Logits exact wherever they may be their row's maximum. token_masks [rows, V / 32] int32: the maximum over
        the tokens whose bit is set (a grammar's), the others' logits -inf."""
        h = hidden.reshape(-1, hidden.shape[-1])
        logits = self.bf16(h).float()
        if token_masks is not None:
            bits = (token_masks[:, :, None] >> self.bit_shifts) & 1
            logits.masked_fill_(bits.view(len(h), -1)[:, :logits.shape[1]] == 0, float("-inf"))
        err = torch.outer(self.C * h.norm(dim=-1), self.row_norms).add_(1e-6)  # 1e-6: products flushed to zero
        top = logits.max(-1, keepdim=True)
        rows, cols = (logits + err >= top.values - err.gather(-1, top.indices)).nonzero(as_tuple=True)
        logits[rows, cols] = (h[rows] * self.weight[cols]).sum(-1)
        return logits.view(*hidden.shape[:-1], -1)
