"""The RMSNorms of a forward pass: float32 rows by this package's C kernel (`hs_rms_norm` in `norm_kernel.h`,
each row alone, ~1 us where torch's composite norm costs ~40 us a call, and a step runs one to four a layer; a prompt
chunk's rows over torch's threads), other dtypes by torch, as transformers computes them; and the queries' and keys'
per-head norms with RoPE, in one pass by the kernel (`norm_and_rotate`)."""
from __future__ import annotations

import torch

from hybridspec.model.attention import rotate
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


def norm_and_rotate(query_key: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                    both: torch.Tensor | None, rope: torch.Tensor, heads: int, eps: float,
                    kernel: bool) -> torch.Tensor:
    """A layer's queries and keys [T, heads + kv_heads, D] (a view of the QKV product's rows) normed where the model
    has per-head norms (q_norm not None, `qk_norm`) and rotated by RoPE (`rotate`; rope [T, 1, D / 2] complex): by the
    kernel in one pass where it takes them (float32), else by `qk_norm` and `rotate`."""
    if kernel and query_key.dtype == torch.float32 and query_key.stride(-1) == 1 and query_key.stride(-2) == \
            query_key.shape[-1] and rope.dtype == torch.complex64:
        tokens, period, dim = query_key.shape
        table = torch.view_as_real(rope.reshape(tokens, dim // 2).contiguous())
        out = torch.empty(query_key.shape, dtype=query_key.dtype, device=query_key.device)
        _products.norm_rotate(query_key.data_ptr(), query_key.stride(0), 0 if q_norm is None else both.data_ptr(),
                              period, eps, table.data_ptr(), out.data_ptr(), tokens * period, dim,
                              torch.get_num_threads())
        return out
    if q_norm is not None:
        query_key = qk_norm(query_key, q_norm, k_norm, both, heads, eps, kernel)
    return rotate(query_key, rope)


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
