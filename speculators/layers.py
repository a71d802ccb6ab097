"""Llama-style blocks of the EAGLE-family drafters (the names match the speculators/vLLM checkpoint layout), the
rotary embedding the target model applies too, and the drafter's own KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Default (unscaled) rotary embedding, applied with rotate-half like Llama. Always float32: a bfloat16 drafter
    would otherwise round the frequencies (no buffer, so `.to(dtype)` cannot)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, device=positions.device,
                                                     dtype=torch.float32) / self.head_dim)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE over the last dim: x [..., n, head_dim] with cos/sin broadcastable to it ([n, head_dim] for
    the drafters, [B, 1, q, head_dim] for the target)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


@dataclass
class LayerConfig:
    """The decoder-layer shape; mirrors the `transformer_layer_config` of a speculators checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def like_target(cls, config: Any, intermediate_size: int | None = None) -> "LayerConfig":
        """The target's attention shape and RoPE, with an optionally smaller MLP (a cheaper drafter)."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        heads = config.num_attention_heads
        return cls(hidden_size=config.hidden_size, intermediate_size=intermediate_size or config.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=getattr(config, "num_key_value_heads", heads),
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(theta),
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", 8192)))


class Attention(nn.Module):
    def __init__(self, cfg: LayerConfig, input_size: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [n, in] -> q [heads, n, d], k and v [kv_heads, n, d], with RoPE applied to q and k."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def expand_kv(self, t: Tensor) -> Tensor:
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)

    def out(self, attn: Tensor) -> Tensor:
        """attn: [heads, n, d] -> [n, hidden]."""
        return self.o_proj(attn.transpose(0, 1).reshape(attn.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, cfg: LayerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer; the first layer of an EAGLE-3/P-EAGLE drafter attends over cat(norm(emb), norm(h)) (2H)
    and keeps h itself (not normed, unless norm_before_residual) as the residual, as vLLM's llama_eagle3 does."""

    def __init__(self, cfg: LayerConfig, first: bool, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.first, self.norm_before_residual = first, norm_before_residual
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size if first else cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attn_input(self, h: Tensor, emb: Tensor | None) -> tuple[Tensor, Tensor]:
        """(attention input, residual) for hidden states h and (first layer only) token embeddings."""
        if not self.first:
            return self.input_layernorm(h), h
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        return torch.cat([self.input_layernorm(emb), normed], dim=-1), residual

    def finish(self, attn_out: Tensor, residual: Tensor) -> Tensor:
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax attention with grouped KV heads. q [heads, n, d], k/v [kv_heads, m, d], mask [n, m] bool (True =
    visible) or None (all). torch's fused kernel: neither the keys copied per query group nor, on long catch-ups, the
    whole score matrix materialised (4x faster than matmul-softmax-matmul at 1,024 queries on this CPU)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]


def causal_mask(num_queries: int, num_past: int, device: torch.device | None = None) -> Tensor:
    """Query i (at absolute slot num_past + i) sees every slot up to and including itself."""
    q = torch.arange(num_queries, device=device)[:, None] + num_past
    return torch.arange(num_past + num_queries, device=device)[None, :] <= q


class DraftKVCache:
    """Per-layer keys and values of a drafter's real (target-fed) slots, [kv_heads, S, d] each, in buffers with room to
    grow (doubling), so a step writes only its new slots instead of copying the whole cache (at 512 positions the
    copies were a fifth of FastEagle's step on the CPU). Slots past `len(self)` are scratch: a step's uncommitted
    slots (P-EAGLE's mask slots) and a `fork`'s."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write n new slots' keys and values of `layer` after the committed ones; the layer's keys and values up to
        them. `commit` keeps some of them."""
        end = self.length + k.shape[1]
        if layer == len(self.keys):
            cap = max(64, 2 * end)
            self.keys.append(k.new_empty(k.shape[0], cap, k.shape[2]))
            self.values.append(v.new_empty(v.shape[0], cap, v.shape[2]))
        elif end > self.keys[layer].shape[1]:
            self.keys[layer] = self._grown(self.keys[layer], end)
            self.values[layer] = self._grown(self.values[layer], end)
        self.keys[layer][:, self.length:end] = k
        self.values[layer][:, self.length:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def _grown(self, buffer: Tensor, end: int) -> Tensor:
        bigger = buffer.new_empty(buffer.shape[0], 2 * end, buffer.shape[2])
        bigger[:, :self.length] = buffer[:, :self.length]
        return bigger

    def commit(self, n: int) -> None:
        """Keep the first n slots written by the last `extend` of every layer."""
        self.length += n

    def fork(self) -> "DraftKVCache":
        """A scratch cache on the same buffers: what it writes past this cache's slots never reaches them."""
        other = DraftKVCache()
        other.keys, other.values, other.length = list(self.keys), list(self.values), self.length
        return other
