"""Gated DeltaNet, the linear attention of Qwen3.5's and Qwen3-Next's hybrid layers (three of them to one
full-attention layer), run so that speculation stays exact.

A layer keeps, per row, a fixed-size state instead of keys and values: the last conv_width inputs of a depthwise
causal convolution, and a recurrent matrix per value head updated by the gated delta rule (`delta_step`). A prompt
chunk runs by transformers' chunked form of the rule from the row's state and writes the state after it (prompt
tokens are always kept). A step's nodes ([last token] + a draft chain or tree) each start from their parent's state:
the convolution reads each node's ancestors (then the row's conv state), the recurrence runs node by node in a
[rows, nodes] table of states that lives for one layer. What becomes the row's state is decided after verification:
the pass leaves each node's convolution input, key, value, decay and beta in the cache (`PendingNodes`), and
`KVCache.commit` replays the accepted path, all layers at once. A step with no draft, a draft rejected at its first
token and a tree are the same code: the state moves by exactly the kept tokens.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F

from hybridspec.model.inputs import ForwardPart
from hybridspec.model.kv_cache import KVCache, PendingNodes, RecurrentShape, delta_step
from hybridspec.model.linear import Linear


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedDeltaNet:
    """One Gated DeltaNet layer's weights (its four input projections as one product) and its forward over the
    parts of a pass. `index`: the layer's place among the model's linear-attention layers (in a cache's states)."""

    __slots__ = ("in_proj", "out", "conv_weight", "conv_bias", "neg_a", "dt_bias", "norm", "eps", "index",
                 "key_heads", "value_heads", "key_dim", "value_dim", "width")

    def __init__(self, module, index: int, pack: bool):
        self.in_proj = Linear(torch.cat(_projections(module)), pack=pack)
        self.out = Linear(module.out_proj.weight, pack=pack)
        self.conv_weight = module.conv1d.weight  # [channels, 1, kernel]
        self.conv_bias = module.conv1d.bias
        self.neg_a = -module.A_log.float().exp()
        self.dt_bias = module.dt_bias
        self.norm, self.eps = module.norm.weight, module.norm.variance_epsilon
        self.index = index
        self.key_heads, self.value_heads = module.num_k_heads, module.num_v_heads
        self.key_dim, self.value_dim = module.head_k_dim, module.head_v_dim
        self.width = module.conv_kernel_size - 1

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.out]

    def shape(self, layers: int, dtype: torch.dtype) -> RecurrentShape:
        channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        return RecurrentShape(layers, channels, self.width, self.value_heads, self.key_dim, self.value_dim, dtype)

    def plus(self, x: torch.Tensor, parts: Sequence[ForwardPart], spans: Sequence[tuple[int, int]],
             residual: torch.Tensor) -> torch.Tensor:
        """residual + the layer's output for the packed inputs x [T, H] (normed) of every part."""
        hv, dv = self.value_heads, self.value_dim
        channels = 2 * self.key_heads * self.key_dim + hv * dv
        mixed, z, b, a = self.in_proj(x).split([channels, hv * dv, hv, hv], dim=-1)
        beta = b.sigmoid().float()
        decay = self.neg_a * F.softplus(a.float() + self.dt_bias)
        if len(parts) == 1:  # one cache's inputs: all of them
            core = self._mix(parts[0], mixed, decay, beta).reshape(x.shape[0], hv, dv)
        else:
            core = x.new_zeros(x.shape[0], hv, dv)
            for part, (lo, hi) in zip(parts, spans):
                core[lo:hi] = self._mix(part, mixed[lo:hi], decay[lo:hi], beta[lo:hi]).flatten(0, 1)
        gated = torch.rms_norm(core.float(), (dv,), self.norm.float(), self.eps) * F.silu(z.view(-1, hv, dv).float())
        return self.out.plus(gated.to(x.dtype).flatten(1), residual)

    def _mix(self, part: ForwardPart, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The layer's core output [b, q, heads, value_dim] for one part: its rows' prompt tokens first, then their
        step nodes (padding: zeros or meaningless)."""
        cache, (b, q) = part.cache, part.tokens.shape
        mixed, decay, beta = mixed.view(b, q, -1), decay.view(b, q, -1), beta.view(b, q, -1)
        prompts = list(part.prompt_lengths or [0] * b)
        if part.node_parents is not None and not any(prompts):  # steps alone
            return self._nodes(cache, part.node_parents, mixed, decay, beta)
        out = mixed.new_zeros(b, q, self.value_heads, self.value_dim)
        for length in sorted(set(prompts) - {0}):  # rows of one prompt length run together
            rows = [r for r, n in enumerate(prompts) if n == length]
            out[rows, :length] = self._prompt(cache, rows, mixed[rows, :length], decay[rows, :length],
                                              beta[rows, :length])
        if part.node_parents is not None:
            start = prompts[0] if b == 1 else 0  # a prompt goes with a one-row cache only
            out[:, start:] = self._nodes(cache, part.node_parents, mixed[:, start:], decay[:, start:],
                                         beta[:, start:])
        return out

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [..., channels] as queries, keys [..., key heads, key_dim], values."""
        hk, dk = self.key_heads, self.key_dim
        q, k, v = y.split([hk * dk, hk * dk, self.value_heads * self.value_dim], dim=-1)
        return q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (self.value_heads, -1))

    def _prompt(self, cache: KVCache, rows: list[int], x: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
        """Prompt tokens x [r, p, channels] of `rows` after their states; the states move past them."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        layer = self.index
        window = torch.cat([cache.conv[layer, rows], x.transpose(1, 2)], dim=-1)  # [r, channels, width + p]
        cache.conv[layer, rows] = window[..., -self.width:]
        y = F.silu(F.conv1d(window, self.conv_weight, self.conv_bias, groups=window.shape[1])).transpose(1, 2)
        q, k, v = self._split(y)
        out, state = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=cache.state[layer, rows],
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        cache.state[layer, rows] = state
        return out

    def _nodes(self, cache: KVCache, parents: torch.Tensor, x: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor) -> torch.Tensor:
        """A step's nodes x [b, n, channels] (parents [b, n]: a node index, -1 for the row's state) -> [b, n, heads,
        value_dim]; leaves what commit replays in the cache's pending nodes."""
        layer, width = self.index, self.width
        b, n, _ = x.shape
        columns, chain = _windows(tuple(map(tuple, parents.tolist())), width)
        source = torch.cat([cache.conv[layer], x.transpose(1, 2)], dim=-1)  # [b, channels, width + n]
        if chain:  # node j's window: columns j .. j + width
            windows = source.unfold(-1, width + 1, 1)
        else:
            index = columns.to(x.device).view(b, 1, n * (width + 1)).expand(-1, source.shape[1], -1)
            windows = source.gather(2, index).view(b, -1, n, width + 1)
        y = (windows * self.conv_weight.view(1, -1, 1, width + 1)).sum(-1)
        if self.conv_bias is not None:
            y = y + self.conv_bias[:, None]
        q, k, v = self._split(F.silu(y).transpose(1, 2))
        group = self.value_heads // self.key_heads
        q, k = _l2_normalised(q.float()) / self.key_dim ** 0.5, _l2_normalised(k.float())
        if group > 1:
            q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
        v = v.float()
        pending = cache.pending
        pending.inputs[layer] = x
        if n > 1:  # what a replay of a partly accepted draft needs (one node is always kept: its state is the pass's)
            pending.keys[layer], pending.values[layer] = k, v
            pending.decays[layer], pending.betas[layer] = decay, beta
        out = q.new_empty(n, b, *v.shape[2:])
        if chain:  # node j's state after node j - 1's, in place: the last is the state a fully accepted chain keeps
            state = cache.state[layer]
            for j in range(n):
                state = delta_step(state, k[:, j], v[:, j], decay[:, j], beta[:, j], None if j == 0 else state,
                                   q[:, j], out[j])
            pending.chain_ends[layer] = state
        else:  # a tree: every node's state, each from its parent's (index 0: the row's)
            states = cache.state.new_empty(b, n + 1, *cache.state.shape[2:])
            states[:, 0] = cache.state[layer]
            every_row = torch.arange(b)
            for j in range(n):
                delta_step(states[every_row, parents[:, j].cpu() + 1], k[:, j], v[:, j], decay[:, j], beta[:, j],
                           states[:, j + 1], q[:, j], out[j])
        return out.transpose(0, 1).to(x.dtype)


def _projections(module) -> list[torch.Tensor]:
    """The rows of the queries, keys, values, z, b and a projections, Qwen3.5's layout. Qwen3-Next fuses them into two
    products grouped by key head ([q, k, the group's v, its z] and [its b, its a] per key head): regrouped here."""
    if hasattr(module, "in_proj_qkv"):
        return [module.in_proj_qkv.weight, module.in_proj_z.weight, module.in_proj_b.weight, module.in_proj_a.weight]
    hk, dk, dv = module.num_k_heads, module.head_k_dim, module.head_v_dim
    group = module.num_v_heads // hk
    qkvz = module.in_proj_qkvz.weight.view(hk, 2 * dk + 2 * group * dv, -1)
    q, k, v, z = qkvz.split([dk, dk, group * dv, group * dv], dim=1)
    b, a = module.in_proj_ba.weight.view(hk, 2 * group, -1).split([group, group], dim=1)
    return [t.flatten(0, 1) for t in (q, k, v, z, b, a)]


@functools.lru_cache(maxsize=256)
def _windows(parents: tuple[tuple[int, ...], ...], width: int) -> tuple[torch.Tensor, bool]:
    """Where each node's convolution window comes from, [b, n, width + 1], as columns of [a row's conv state (width
    columns), its nodes' inputs (n columns)]: the node's `width` nearest ancestors, then the conv state's last
    columns, itself last; and whether every row is a chain. Every layer of a pass asks for the same parents."""
    n = len(parents[0])
    columns = torch.empty(len(parents), n, width + 1, dtype=torch.long)
    for r, row in enumerate(parents):
        for j in range(n):
            path, node = [width + j], row[j]
            while len(path) <= width and node >= 0:
                path.append(width + node)
                node = row[node]
            path += range(width - 1, width - 1 - (width + 1 - len(path)), -1)
            columns[r, j] = torch.tensor(path[::-1])
    return columns, all(row == tuple(range(-1, n - 1)) for row in parents)


def new_pending(shape: RecurrentShape, rows: int, nodes: int, device: torch.device) -> PendingNodes:
    """Room for what a pass computes at `nodes` step inputs of `rows` rows, every linear-attention layer."""
    def room(*tail: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape.layers, rows, nodes, *tail, dtype=dtype, device=device)

    return PendingNodes(room(shape.channels, dtype=shape.dtype), room(shape.heads, shape.key_dim),
                        room(shape.heads, shape.value_dim), room(shape.heads), room(shape.heads), [None] * shape.layers)
