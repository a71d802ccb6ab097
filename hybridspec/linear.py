"""Linear layers for small-batch inference on a CPU: MKL's product for a few rows, oneDNN's with a weight packed once
for more; `pack_linears` swaps them into any module (the drafters)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """y = x @ weight.T (+ bias): MKL's product for a few rows, oneDNN's with a prepacked weight for more (CPUs).

    Why two: verification multiplies a handful of rows (1 + k draft tokens) by every weight matrix, and a decode step is
    bound by reading those weights. MKL (torch's default, F.linear) streams a plain weight fastest for up to
    `PLAIN_MAX_ROWS` rows (a matrix-vector product), but repacks it on every call from there on, so its cost grows with
    the rows; oneDNN with a weight packed once stays near its one-row cost up to several rows, with a higher fixed cost
    (measured: BENCHMARKS.md, "Verification cost on this CPU"). A float32 weight is kept in both layouts (the packed
    copy is as large as the weight); elsewhere it is F.linear.
    """

    PLAIN_MAX_ROWS = 3  # on this CPU, for SmolLM2's matrices (`bench_verify_cost.py --plain-max-rows N` compares)

    __slots__ = ("weight", "bias", "packed", "compute_dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 compute_dtype: torch.dtype | None = None):
        # compute_dtype: multiply in this dtype (inputs cast to it, outputs back to the input's dtype)
        self.compute_dtype = compute_dtype if compute_dtype not in (None, weight.dtype) else None
        if self.compute_dtype is not None:
            weight = weight.to(self.compute_dtype)
            bias = None if bias is None else bias.to(self.compute_dtype)
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack and _onednn_available(weight) \
            else None
        # the plain weight stays for MKL's few-row products, except in bfloat16 (torch repacks it for every call)
        self.weight = weight if self.packed is None or weight.dtype == torch.float32 else None

    def _plain(self, x: torch.Tensor) -> bool:
        return self.packed is None or (self.weight is not None and x.numel() <= self.PLAIN_MAX_ROWS * x.shape[-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            return self(x.to(self.compute_dtype)).to(x.dtype)
        if self._plain(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the addition fused into the product (a residual connection: one pass less)."""
        if self.compute_dtype is not None or residual.shape[:-1] != x.shape[:-1]:
            return residual + self(x)
        if self._plain(x):
            bias_and_residual = residual if self.bias is None else residual + self.bias
            return torch.addmm(bias_and_residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]),
                               self.weight.t()).view(residual.shape)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), self.packed, self.bias, "add")


class PackedLinear(torch.nn.Module):
    """Inference-only stand-in for an nn.Linear, computing with `Linear`; keeps `weight`, `bias`, `in_features` and
    `out_features` for code that reads them."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = Linear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(),
                             compute_dtype=compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 / AMX): oneDNN then runs a small-batch bfloat16
    product faster than float32 (half the weight bytes to read)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Swap every nn.Linear inside `module` for a `PackedLinear` (a drafter run next to the target at small batch),
    multiplying in compute_dtype if given."""
    for name, child in module.named_children():
        if type(child) is torch.nn.Linear:
            setattr(module, name, PackedLinear(child, compute_dtype))
        else:
            pack_linears(child, compute_dtype)
    return module
