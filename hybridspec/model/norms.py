"""The RMSNorms of a forward pass: float32 rows by this package's C kernel (`hs_rms_norm` in `product_kernel.h`,
each row alone, ~1 us where torch's composite norm costs ~40 us a call, and a step runs one to four a layer; a prompt
chunk's rows over torch's threads), other dtypes by torch, as transformers computes them."""
from __future__ import annotations

import torch

from hybridspec.model.linear import _products


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: bool) -> torch.Tensor:
    """x [..., dim] normed by weight [dim]; `kernel`: by the C kernel where it takes x (float32)."""
    if x.dtype == torch.float32:
        if kernel:
            return _kernel_norm(x, weight, eps, 1)
        return torch.rms_norm(x, weight.shape, weight, eps)
    inverse_rms = x.float().pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x.float() * inverse_rms).to(x.dtype) * weight


def qk_norm(query_key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, both: torch.Tensor, heads: int,
            eps: float, kernel: bool) -> torch.Tensor:
    """Qwen3's and Gemma's per-head norms of queries and keys, query_key [T, heads + kv_heads, D] (a view of the QKV
    product's rows): one kernel call for both (`both`: [heads + kv_heads, D], each head's weight), or a norm each."""
    if kernel and query_key.dtype == torch.float32:
        return _kernel_norm(query_key, both, eps, query_key.shape[1])
    return torch.cat([rms_norm(query_key[:, :heads], q_norm, eps, False),
                      rms_norm(query_key[:, heads:], k_norm, eps, False)], dim=1)


def _kernel_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, period: int) -> torch.Tensor:
    """RMSNorm by the C kernel of x [..., dim] by weight [dim] (period 1), or of x [T, period, dim] by weight [period,
    dim], row r by weight[r % period] (a token's query and key heads)."""
    dim = x.shape[-1]
    if period == 1:
        flat = x.reshape(-1, dim)
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    else:
        flat = x if x.stride(-1) == 1 and x.stride(-2) == dim else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _products.rms_norm(flat.data_ptr(), flat.stride(0), weight.data_ptr(), period, eps, out.data_ptr(),
                       x.numel() // dim, dim, torch.get_num_threads())
    return out
