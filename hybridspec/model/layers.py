"""A decoder layer's weights in the layout `TargetModel`'s fused forward uses: one product for Q, K and V (rows in
rotary pair order; Qwen3.5's output gate with them), one for gate and up; a dense gated MLP or a sparse mixture of
experts (Qwen3.5's with a gated shared expert); q/k norms, a sliding window, sinks and Gemma's norms around attention
and MLP outputs where the architecture has them; or Qwen3.5's Gated DeltaNet in place of attention
(`hybridspec.model.delta_net`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridspec.model.attention import interleave_rotary_pairs
from hybridspec.model.delta_net import GatedDeltaNet
from hybridspec.model.linear import (KERNEL_ROWS, Linear, _products, amx_pack, amx_product, compact_weights,
                                     weight_format)

# the most (token, expert) pairs a mixture of experts multiplies by the small-row kernel in one call for the layer
# (a few tokens' steps, `step_expert_sums`); more (a prompt chunk) by the kernel on the experts' packed panels
EXPERT_KERNEL_PAIRS = 64


def layer_window(config, layer_id: int) -> int | None:
    """The sliding window of a layer's attention (it sees its last `window` positions, itself included), or None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and types[layer_id] != "sliding_attention"):
        return None
    return int(window)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def is_gemma(config) -> bool:
    return config.model_type.startswith("gemma")


def norm_weight(norm, config) -> torch.Tensor:
    """An RMSNorm's multiplier: Gemma's, Qwen3.5's and Qwen3-Next's norms scale by 1 + weight (in float32), the others
    by weight."""
    zero_centred = is_gemma(config) or config.model_type.startswith(("qwen3_5", "qwen3_next"))
    return (1.0 + norm.weight.float()).to(norm.weight.dtype) if zero_centred else norm.weight


def rotary_dim(config, head_dim: int) -> int:
    """The dimensions of a head that RoPE rotates (Qwen3.5: the first quarter; the rest pass unrotated)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    factor = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    return int(head_dim * factor)


def gated_activation(gate_up: torch.Tensor, activation: tuple[int, float, float]) -> torch.Tensor:
    """A gated MLP's hidden units from its gate_up product [T, 2 n] (gate columns, then up): activation KERNEL_SILU
    (silu(gate) * up) or KERNEL_CLAMPED_SWIGLU with its alpha and limit, by the kernel the panel kernel's gated tiles
    share (the same bits for a step's few rows as for a prompt chunk's), in one pass. float32 rows on a CPU."""
    n = gate_up.shape[-1] // 2
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], n)
    _products.gated_rows(gate_up.data_ptr(), gate_up.stride(0), gate_up.shape[0], n, *activation, out.data_ptr(),
                         torch.get_num_threads())
    return out


class _DenseMLP:
    """A gated MLP: down(act(gate(x)) * up(x)), gate and up as one product (SwiGLU, by the kernel where it runs;
    Gemma's GELU-tanh)."""

    __slots__ = ("gate_up", "down", "act", "kernel")

    def __init__(self, mlp, config, pack: bool):
        self.gate_up = Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), _cat_bias(
            mlp.gate_proj.bias, mlp.up_proj.bias), pack=pack)
        self.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias, pack=pack)
        self.act = ACTIVATIONS[getattr(config, "hidden_activation", None) or config.hidden_act]
        weight = mlp.down_proj.weight
        self.kernel = bool(KERNEL_ROWS) and self.act is F.silu and weight.dtype == torch.float32 and \
            weight.device.type == "cpu"

    def linears(self) -> list[Linear]:
        return [self.gate_up, self.down]

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return gated_activation(self.gate_up(x), (KERNEL_SILU, 0.0, 0.0))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.act(gate).mul_(up)  # into the activation's fresh output

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self._gated(x))

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down.plus(self._gated(x), residual)


class _MixtureOfExperts:
    """A sparse MoE block: each token's router picks top_k experts and only those experts' weights are multiplied,
    token rows grouped per expert; their outputs summed in expert order, then added to the residual, as transformers
    does. Qwen3-MoE: softmax over all experts, then the top_k (renormalised where the model says so), SwiGLU experts.
    gpt-oss: the top_k logits (the router has a bias), then their softmax; experts with biases and a clamped SwiGLU
    (alpha, limit) whose gate and up rows are interleaved in the checkpoint."""

    __slots__ = ("router", "experts", "top_k", "renormalise", "softmax_first", "clamp", "shared", "shared_gate",
                 "stacked", "kernel", "panels", "gate_up_bias_panels", "amx")

    def __init__(self, block, config, pack: bool):
        experts = block.experts
        if hasattr(block, "router"):  # gpt-oss: weights stored [in, out], gate and up interleaved
            self.router = Linear(block.router.weight, block.router.bias, pack=pack)
            pairs = lambda w: torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)  # noqa: E731
            gate_up, gate_up_bias = pairs(experts.gate_up_proj).transpose(1, 2), pairs(experts.gate_up_proj_bias)
            down, down_bias = experts.down_proj.transpose(1, 2), experts.down_proj_bias
            self.softmax_first, self.renormalise = False, False
            self.clamp = (float(experts.alpha), float(experts.limit))
        else:
            self.router = Linear(block.gate.weight, pack=pack)
            gate_up, gate_up_bias, down, down_bias = experts.gate_up_proj, None, experts.down_proj, None
            self.softmax_first, self.renormalise = True, bool(getattr(config, "norm_topk_prob", True))
            self.clamp = None
        # every expert's weights in one tensor [experts, out, in] (and biases [experts, out]), each expert's Linear a
        # view of it: the small-row kernel multiplies a few tokens' chosen experts in one call
        gate_up, down = gate_up.contiguous(), down.contiguous()
        gate_up_bias = None if gate_up_bias is None else gate_up_bias.contiguous()
        down_bias = None if down_bias is None else down_bias.contiguous()
        self.stacked = (gate_up, gate_up_bias, down, down_bias)
        self.kernel = bool(KERNEL_ROWS) and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu"
        # with the kernels, prompt chunks read the experts' panels (in place of oneDNN's packed copy of each expert)
        self.panels = (pack_panels(gate_up, gated=True), pack_panels(down)) if self.kernel else None
        self.gate_up_bias_panels = gated_order(gate_up_bias) if self.kernel and gate_up_bias is not None else None
        self.experts = [(Linear(gate_up[e], None if gate_up_bias is None else gate_up_bias[e], pack=pack and not
                                self.kernel),
                         Linear(down[e], None if down_bias is None else down_bias[e], pack=pack and not self.kernel))
                        for e in range(gate_up.shape[0])]
        self.amx = None
        if self.kernel:  # a step streams its chosen experts' weights: bfloat16 or float16 where that holds them
            (compact_gate_up, compact_down), name = compact_weights(gate_up, down)
            self.stacked = (compact_gate_up, gate_up_bias, compact_down, down_bias)
            if name == _products.WEIGHT_BF16:  # prompt chunks on AMX tiles (where there are), in place of the panels
                packed = [(amx_pack(g), amx_pack(d)) for g, d in zip(gate_up, down)]
                if all(g is not None and d is not None for g, d in packed):
                    self.amx, self.panels, self.gate_up_bias_panels = packed, None, None
        self.top_k = int(config.num_experts_per_tok)
        # Qwen3.5's shared expert, on every token, its output scaled by sigmoid(shared_gate(x))
        self.shared = self.shared_gate = None
        if getattr(block, "shared_expert", None) is not None:
            self.shared = _DenseMLP(block.shared_expert, config, pack)
            self.shared_gate = Linear(block.shared_expert_gate.weight, pack=pack)

    def linears(self) -> list[Linear]:
        shared = [] if self.shared is None else [*self.shared.linears(), self.shared_gate]
        return [self.router] + [lin for pair in self.experts for lin in pair] + shared

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return gated_activation(gate_up, self.kernel_activation)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.clamp is None:
            return F.silu(gate) * up
        alpha, limit = self.clamp
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))  # transformers' order, so its values to the bit

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, top_k] and their weights [T, top_k], as the model's router picks them."""
        logits = self.router(x)
        if self.softmax_first:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
            if self.renormalise:
                weights /= weights.sum(dim=-1, keepdim=True)
        else:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        return weights, chosen

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            return self.experts_sum(x, *self.route(x), residual=residual)
        out = self.experts_sum(x, *self.route(x))
        return residual + (out + torch.sigmoid(self.shared_gate(x)) * self.shared(x))

    def experts_sum(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's chosen experts' outputs by their weights, summed in expert order (as transformers does), then
        added to `residual` where one is given."""
        kernel = self.kernel and x.dtype == torch.float32
        if kernel and chosen.numel() <= EXPERT_KERNEL_PAIRS and self.top_k <= _products.EXPERT_SUM_MAX_K:
            return step_expert_sums(x, weights, chosen, self.stacked, self.kernel_activation, residual)
        order = torch.argsort(chosen.reshape(-1), stable=True)  # (token, k) pairs grouped by expert
        counts = torch.bincount(chosen.reshape(-1), minlength=len(self.experts))
        rows, pair_weights = order // self.top_k, weights.to(x.dtype).reshape(-1)[order]
        if kernel:  # a prompt chunk, weighted in the kernel
            products = self._chunk_experts(x, rows, counts, pair_weights)
        else:  # each expert's rows by its own Linear
            products, begin = x.new_empty(len(order), x.shape[-1]), 0
            for expert, count in enumerate(counts.tolist()):
                if count:
                    gate_up, down = self.experts[expert]
                    products[begin:begin + count] = down(self._activation(gate_up(x[rows[begin:begin + count]])))
                    begin += count
            products *= pair_weights[:, None]
        if not kernel or self.top_k > _products.EXPERT_SUM_MAX_K:
            out = torch.zeros_like(x).index_add_(0, rows, products)
            return out if residual is None else residual + out
        # each token's rows among the products, summed by the kernel in the order index_add_ would add them
        residual = None if residual is None else residual.contiguous()
        out = x.new_empty(x.shape[0], products.shape[1])
        _products.expert_sums(products.data_ptr(), products.stride(0), order.data_ptr(), x.shape[0], self.top_k,
                              products.shape[1], 0 if residual is None else residual.data_ptr(), out.data_ptr(),
                              torch.get_num_threads())
        return out

    @property
    def kernel_activation(self) -> tuple[int, float, float]:
        """The experts' activation as the kernels take it: KERNEL_SILU, or KERNEL_CLAMPED_SWIGLU with alpha and
        limit."""
        return (KERNEL_SILU, 0.0, 0.0) if self.clamp is None else (KERNEL_CLAMPED_SWIGLU, *self.clamp)

    def _chunk_experts(self, x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor,
                       scales: torch.Tensor) -> torch.Tensor:
        """down(act(gate_up(x[rows]))) * scales, the pairs grouped by expert (`counts` a row each), by the panel
        kernel: one call for every chosen expert's gate_up and its activation, one for their down (experts of
        bfloat16 values on a CPU with AMX: `_amx_chunk_experts`)."""
        if self.amx is not None:
            return self._amx_chunk_experts(x, rows, counts, scales)
        experts = counts.nonzero().reshape(-1)
        counts = counts[experts]
        starts = torch.cumsum(counts, 0) - counts
        gate_up, _, down, down_bias = self.stacked
        hidden = grouped_expert_products(x, rows, self.panels[0], self.gate_up_bias_panels, gate_up.shape[1] // 2,
                                         experts, starts, counts, activation=self.kernel_activation)
        return grouped_expert_products(hidden, None, self.panels[1], down_bias, down.shape[1], experts, starts,
                                       counts, scales)

    def _amx_chunk_experts(self, x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor,
                           scales: torch.Tensor) -> torch.Tensor:
        """`_chunk_experts` on AMX tiles (experts of bfloat16 values): each chosen expert's rows gathered, its gate_up
        (and bias), the activation, its down (and bias), then every pair's row times its router weight."""
        gate_up, gate_up_bias, down, down_bias = self.stacked
        products, begin = x.new_empty(len(rows), down.shape[1]), 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                packed_gate_up, packed_down = self.amx[expert]
                hidden = gated_activation(amx_product(x[rows[begin:begin + count]], packed_gate_up, gate_up.shape[1],
                                                      None if gate_up_bias is None else gate_up_bias[expert]),
                                          self.kernel_activation)
                products[begin:begin + count] = amx_product(hidden, packed_down, down.shape[1],
                                                            None if down_bias is None else down_bias[expert])
                begin += count
        return products.mul_(scales[:, None])


# the panel kernel's activations of gated experts (`hs_grouped_products`)
KERNEL_SILU, KERNEL_CLAMPED_SWIGLU = 1, 2


def gated_order(gate_up_bias: torch.Tensor) -> torch.Tensor:
    """Experts' gate_up biases [experts, 2 * units] in the gated panels' order (`_gated_rows`), [experts, tiles, 32]."""
    return torch.stack([_gated_rows(b) for b in gate_up_bias]).view(gate_up_bias.shape[0], -1, _products.PANEL)


def pack_panels(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """Experts' weights [experts, n, k] as the panels `grouped_expert_products` reads: [experts, tiles, k, PANEL],
    panel t holding output columns [t * PANEL, (t + 1) * PANEL) (zero past n); gated: a gate_up weight with its rows
    in `gated_order`. Packed an expert at a time."""
    experts, n, k = weight.shape
    tiles = -(-n // _products.PANEL)
    panels = None
    for e in range(experts):
        rows = _gated_rows(weight[e]) if gated else F.pad(weight[e], (0, 0, 0, tiles * _products.PANEL - n))
        if panels is None:
            panels = weight.new_empty(experts, rows.shape[0] // _products.PANEL, k, _products.PANEL)
        panels[e].copy_(rows.view(-1, _products.PANEL, k).transpose(1, 2))
    return panels


def _gated_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [2 * units, ...] (gate rows, then up rows) -> [32 * tiles, ...]: per 16 units their gate rows, then
    their up rows, zero rows past `units` (what a gated panel holds)."""
    units = gate_up.shape[0] // 2
    per = _products.GATED_UNITS
    tiles = -(-units // per)
    pad = (0, 0) * (gate_up.dim() - 1) + (0, tiles * per - units)
    gate, up = F.pad(gate_up[:units], pad), F.pad(gate_up[units:], pad)
    return torch.stack([gate.unflatten(0, (tiles, per)), up.unflatten(0, (tiles, per))], dim=1).flatten(0, 2)


def grouped_expert_products(x: torch.Tensor, x_rows: torch.Tensor | None, panels: torch.Tensor,
                            bias: torch.Tensor | None, n: int, experts: torch.Tensor, starts: torch.Tensor,
                            counts: torch.Tensor, scales: torch.Tensor | None = None,
                            activation: tuple[int, float, float] = (0, 0.0, 0.0),
                            blocking: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Pairs [starts[s], starts[s] + counts[s]) by expert experts[s]: row p = (x[x_rows[p]] (x[p] where x_rows is
    None) @ w[experts[s]].T + its bias) * scales[p], w given as its panels (`pack_panels`), by the panel kernel.
    activation (KERNEL_SILU, or KERNEL_CLAMPED_SWIGLU with alpha and limit): w a gated gate_up (bias in
    `gated_order`), the rows its n hidden units. blocking: the kernel's slice of k and panels a group (0, 0: this
    CPU's; the same bits whatever they are)."""
    x = x.contiguous()
    pairs, act, alpha, limit = int(counts.sum()), *activation
    out = x.new_empty(pairs, n)
    sums = x.new_empty(pairs, panels.shape[1] * _products.PANEL) if act else out  # between slices of k
    _products.grouped_products(x.data_ptr(), x.stride(0), 0 if x_rows is None else x_rows.data_ptr(),
                               panels.data_ptr(), 0 if bias is None else bias.data_ptr(), n, panels.shape[2],
                               experts.data_ptr(), starts.data_ptr(), counts.data_ptr(), len(experts),
                               0 if scales is None else scales.data_ptr(), sums.data_ptr(), sums.stride(0), act,
                               alpha, limit, out.data_ptr(), out.stride(0), *blocking, torch.get_num_threads())
    return out


def step_expert_sums(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, stacked: tuple,
                     activation: tuple[int, float, float], residual: torch.Tensor | None = None) -> torch.Tensor:
    """A few tokens' mixture of experts (a step's): residual (where given) + each token's chosen experts' outputs
    (chosen, weights [tokens, top_k]) by their weights, summed in expert order, by one kernel call (`hs_moe_step`: the
    small-row kernel on the chosen experts' weights only). stacked: the experts' (gate_up [E, 2 units, hidden], its
    bias, down [E, hidden, units], its bias), biases or None."""
    gate_up, gate_up_bias, down, down_bias = stacked
    x, chosen = x.contiguous(), chosen.contiguous()
    weights = weights.to(torch.float32).contiguous()
    residual = None if residual is None else residual.contiguous()
    out = x.new_empty(x.shape[0], down.shape[1])
    _products.moe_step(x.data_ptr(), x.stride(0), x.shape[0], chosen.shape[1], chosen.data_ptr(), weights.data_ptr(),
                       gate_up.shape[0], gate_up.data_ptr(), 0 if gate_up_bias is None else gate_up_bias.data_ptr(),
                       down.data_ptr(), 0 if down_bias is None else down_bias.data_ptr(), weight_format(down),
                       down.shape[2], down.shape[1], *activation, 0 if residual is None else residual.data_ptr(),
                       out.data_ptr(), torch.get_num_threads())
    return out


def _cat_bias(*biases: torch.Tensor | None) -> torch.Tensor | None:
    return torch.cat(biases) if all(b is not None for b in biases) else None


class DecoderLayer:
    """One decoder layer's weights in the layout the fused forward uses: attention (`qkv`, `o`; with a per-head output
    gate `gated`, Qwen3.5's) or Qwen3.5's linear attention (`delta`), then the MLP. kind_index: the layer's place
    among the model's layers of its kind, in the KV cache (`kv_index`) or among the cache's recurrent states."""

    __slots__ = ("input_norm", "qkv", "q_norm", "k_norm", "qk_norm", "o", "gated", "attn_out_norm", "post_norm", "mlp",
                 "mlp_out_norm", "window", "sinks", "rope_kind", "delta", "kv_index")

    def __init__(self, layer, config, layer_id: int, pack: bool, heads: int, kv_heads: int, head_dim: int,
                 kind_index: int):
        self.input_norm = norm_weight(layer.input_layernorm, config)
        # Gemma normalises the attention's and the MLP's outputs too, before each residual addition
        self.attn_out_norm = self.mlp_out_norm = None
        if hasattr(layer, "pre_feedforward_layernorm"):
            self.attn_out_norm = norm_weight(layer.post_attention_layernorm, config)
            self.post_norm = norm_weight(layer.pre_feedforward_layernorm, config)
            self.mlp_out_norm = norm_weight(layer.post_feedforward_layernorm, config)
        else:
            self.post_norm = norm_weight(layer.post_attention_layernorm, config)
        mlp = layer.mlp
        self.mlp = _MixtureOfExperts(mlp, config, pack) if hasattr(mlp, "experts") else _DenseMLP(mlp, config, pack)
        self.window = self.sinks = self.rope_kind = self.qkv = self.o = self.q_norm = self.k_norm = None
        self.qk_norm = None
        self.gated, self.delta, self.kv_index = False, None, None
        if hasattr(layer, "linear_attn"):
            self.delta = GatedDeltaNet(layer.linear_attn, kind_index, pack)
            return
        self.kv_index = kind_index
        attn = layer.self_attn
        rotary = rotary_dim(config, head_dim)
        q_weight, q_bias = attn.q_proj.weight, attn.q_proj.bias
        gate_rows = []
        if q_weight.shape[0] == 2 * heads * head_dim:  # Qwen3.5: each head's query rows, then its gate's
            self.gated = True
            per_head = q_weight.view(heads, 2, head_dim, -1)
            q_weight, gate_rows = per_head[:, 0].flatten(0, 1), [per_head[:, 1].flatten(0, 1)]
            if q_bias is not None:
                raise ValueError("a gated attention's query bias is not supported")
        # One matrix for Q, K and V (and one for gate and up): fewer, larger matmuls per layer.
        weights = [interleave_rotary_pairs(q_weight, heads, head_dim, rotary),
                   interleave_rotary_pairs(attn.k_proj.weight, kv_heads, head_dim, rotary), attn.v_proj.weight,
                   *gate_rows]
        biases = [q_bias, attn.k_proj.bias, attn.v_proj.bias]
        bias = None
        if all(b is not None for b in biases):
            bias = torch.cat([interleave_rotary_pairs(biases[0], heads, head_dim, rotary),
                              interleave_rotary_pairs(biases[1], kv_heads, head_dim, rotary), biases[2]])
        self.qkv = Linear(torch.cat(weights), bias, pack)
        # Qwen3's and Gemma's per-head RMSNorm of queries and keys, its weight in the same pair order as their rows;
        # Gemma's attention scale (query_pre_attn_scalar ** -0.5, not head_dim's) goes into the queries' norm
        if getattr(attn, "q_norm", None) is not None:
            scale = getattr(config, "query_pre_attn_scalar", head_dim) ** -0.5 / head_dim ** -0.5
            self.q_norm = interleave_rotary_pairs(norm_weight(attn.q_norm, config) * scale, 1, head_dim, rotary)
            self.k_norm = interleave_rotary_pairs(norm_weight(attn.k_norm, config), 1, head_dim, rotary)
            # both as one [heads + kv_heads, head_dim] table: a token's query and key heads normed in one call
            self.qk_norm = torch.cat([self.q_norm.expand(heads, -1), self.k_norm.expand(kv_heads, -1)]).contiguous()
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias, pack=pack)
        self.window = layer_window(config, layer_id)
        # Gemma's local and global layers rotate by different bases: the key of this layer's rotary table (None: the
        # model's one table)
        self.rope_kind = config.layer_types[layer_id] if is_gemma(config) else None
        sinks = getattr(attn, "sinks", None)  # gpt-oss: a softmax logit per head with no value
        self.sinks = None if sinks is None else sinks.detach().float().contiguous()  # as the kernels read them

    def linears(self) -> list[Linear]:
        mixer = self.delta.linears() if self.delta is not None else [self.qkv, self.o]
        return mixer + self.mlp.linears()
