"""The output layer of a greedy step. Greedy verification needs only each row's argmax of the logits, so for a small
pass `GreedyHead` multiplies the output layer's weight rounded to int8 (a quarter of the float32 layer's bytes; the
layer is a quarter to a half of what a decode step of a large-vocabulary model reads) and recomputes in float32 only
the logits of the tokens that could still be the maximum under the rounding's error bound: its argmax is exactly the
float32 one.
"""
from __future__ import annotations

import torch

from hybridspec.model.linear import KERNEL_ROWS, _products

ROUNDOFF = 2.0 ** -24  # float32's unit roundoff
SLACK = 1e-6  # added to every logit's error bound: products flushed to zero
QUANTISE_ROWS = 8192  # rows of the weight rounded (and their error bound taken in float64) at a time: bounded memory


class GreedyHead:
    """The output layer of a greedy step, whose logits matter only where they are a row's maximum: the product on the
    weight rounded to int8 per row (`hs_int8_product`), then exact float32 logits for every token that could be the
    maximum.

    Why: a decode step reads every weight once, and the output layer of a 150k-250k vocabulary is a quarter (Qwen3-MoE)
    to a half (gpt-oss) of the bytes a decode token reads in float32; in int8 it is a quarter as many. Exact: with
    w_i = s_i q_i - e_i (q_i int8, s_i = max |w_i| / 127), the int8 logit a_i = s_i (h . q_i) (float32 sums) differs
    from the float32 logit f_i = h . w_i by at most |h| bound_i, bound_i = |e_i| + 2 k u (s_i |q_i| + |w_i|)
    (Cauchy-Schwarz on the rounding e_i, taken in float64; then both float32 sums' roundings, u = 2^-24, doubled for
    margin). So the float32 argmax is among the tokens whose a_i + err_i reaches the row's max_j (a_j - err_j) (on
    random-weight models of realistic shapes, a few dozen): those logits are recomputed in float32
    (`hs_head_recheck`), the rest stay below the maximum.
    """

    MAX_ROWS = 8  # the most rows a pass takes this head with: a token and 7 draft tokens

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().contiguous()  # [V, H] float32, the model's own (no copy)
        vocab, hidden = weight.shape
        # rows padded with zeros to a multiple of 16 bytes: the kernel reads whole vectors
        self.q = torch.zeros(vocab, -(-hidden // 16) * 16, dtype=torch.int8)
        self.scales = torch.empty(vocab, dtype=torch.float32)
        self.bounds = torch.empty(vocab, dtype=torch.float32)
        for lo in range(0, vocab, QUANTISE_ROWS):
            w = weight[lo:lo + QUANTISE_ROWS].detach().float()
            scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            q = torch.round(w / scales[:, None]).clamp_(-127, 127)
            self.q[lo:lo + QUANTISE_ROWS, :hidden] = q.to(torch.int8)
            self.scales[lo:lo + QUANTISE_ROWS] = scales
            s64, q64, w64 = scales.double(), q.double(), w.double()
            rounding = (s64[:, None] * q64 - w64).norm(dim=1)
            sums = 2 * hidden * ROUNDOFF * (s64 * q64.norm(dim=1) + w64.norm(dim=1))
            self.bounds[lo:lo + QUANTISE_ROWS] = ((rounding + sums) * (1 + 1e-3)).float()
        self.bit_shifts = torch.arange(32, dtype=torch.int32, device=weight.device)
        self.recomputed = 0  # the float32 logits the last call recomputed

    @staticmethod
    def runs_here(weight: torch.Tensor) -> bool:
        """Whether this head runs for `weight`: float32 on a CPU with the product kernel (AVX-512)."""
        return bool(KERNEL_ROWS) and weight.dtype == torch.float32 and weight.device.type == "cpu"

    def approximate(self, h: torch.Tensor) -> torch.Tensor:
        """The int8 logits of rows h [rows, H] (rows up to the kernel's limit), [rows, V] float32."""
        h = h if h.stride(-1) == 1 else h.contiguous()
        if _products is None or not KERNEL_ROWS:  # a CPU without the kernel (tests): the same rounded weight
            return (h @ self.q[:, :h.shape[1]].T.float()) * self.scales
        out = h.new_empty(h.shape[0], self.q.shape[0])
        _products.int8_product(h.data_ptr(), h.stride(0), self.q.data_ptr(), self.q.stride(0), self.scales.data_ptr(),
                               self.q.shape[0], h.shape[1], out.data_ptr(), out.stride(0), h.shape[0],
                               torch.get_num_threads())
        return out

    def __call__(self, hidden: torch.Tensor, token_masks: torch.Tensor | None = None) -> torch.Tensor:
        """Logits exact wherever they may be their row's maximum. token_masks [rows, V / 32] int32: the maximum over
        the tokens whose bit is set (a grammar's), the others' logits -inf."""
        h = hidden.reshape(-1, hidden.shape[-1])
        h = h if h.stride(-1) == 1 else h.contiguous()
        logits = self.approximate(h)
        if token_masks is not None:
            bits = (token_masks[:, :, None] >> self.bit_shifts) & 1
            logits.masked_fill_(bits.view(len(h), -1)[:, :logits.shape[1]] == 0, float("-inf"))
        if _products is not None and KERNEL_ROWS:
            self.recomputed = _products.head_recheck(h.data_ptr(), h.stride(0), self.weight.data_ptr(),
                                                     *self.weight.shape, self.bounds.data_ptr(), SLACK,
                                                     logits.data_ptr(), logits.stride(0), h.shape[0])
        else:  # the same rule in torch
            err = torch.outer(h.norm(dim=-1), self.bounds).add_(SLACK)
            lower = (logits - err).max(-1, keepdim=True).values
            rows, cols = ((logits + err >= lower) & (logits > float("-inf"))).nonzero(as_tuple=True)
            logits[rows, cols] = (h[rows] * self.weight[cols]).sum(-1)
            self.recomputed = len(rows)
        return logits.view(*hidden.shape[:-1], -1)
