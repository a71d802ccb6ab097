"""The target model: prefill, and verification of a chain or a tree of draft tokens in one forward pass.

`TargetModel` runs the forward pass of a Llama-family causal LM (Llama, SmolLM2, Mistral, Qwen2) itself, over the
weights of the loaded transformers model, with a preallocated KV cache of B rows (one per sequence in flight):

- A step feeds each row its last committed token followed by its draft nodes ([B, q] tokens, a cache's rows padded to
  the same q; the caches of one pass, concurrent calls and a prompt's chunk beside them, packed without padding).
  Node i of a row sits at position base + depth(i) and attends to the row's committed prefix plus its own ancestors:
  one 4D boolean mask [B, 1, q, kv] serves chains, trees, per-row lengths and padding alike.
- After verification only the accepted path is kept: for a chain the row's length just moves forward (a crop of the
  rejected suffix); for a tree the accepted nodes' keys and values are gathered into consecutive slots (compaction).
- Hidden states that drafters read (inputs of layers 2, L//2 and L-3, and the final normed state) are returned on
  request.
- A greedy step needs only each row's argmax: its output layer runs in bfloat16, with the tokens that could be the
  maximum recomputed in float32 (`_GreedyHead`; the argmax is the float32 one).

Why not `model(..., past_key_values=DynamicCache)`: a DynamicCache grows by `torch.cat` of every layer's keys and
values at every step, and `crop` leaves strided views behind; measured here, transformers' own forward spent more time
in those concatenations than in the matrix work. A static cache written in place, fused QKV / gate-up projections
(`Linear`: MKL's product for a few rows, oneDNN's with a prepacked weight for more) and a precomputed rotary table
leave mostly the matrix work, for the baseline and the speculative path alike (both use this class).

Batching uses padding (one cache tensor with B rows, each with its own length, positions and draft) rather than B
separate caches run one after another: a decode step is bound by reading the weights, so B rows in one pass cost
little more than one row, while separate caches read the weights B times (`python benchmarks/bench_verify_cost.py
--batch` measures it).

The KV cache is `hybridspec.model.kv_cache`, the linear layers `hybridspec.model.linear`.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from hybridspec.model.kv_cache import KVCache, tree_depths_and_mask
from hybridspec.model.linear import Linear, fast_bf16, tune_products
from hybridspec.speculators.features import default_aux_layer_ids

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# PyTorch's CPU flash attention, which also returns the log-sum-exp of each query's scores (GQA without repeats).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
try:  # the attention kernel of decode and verification steps on a CPU (built with the package; AVX-512 CPUs)
    from hybridspec.model import _attention as _step_attention
except ImportError:  # pragma: no cover - a build without it: PyTorch's attention throughout
    _step_attention = None
# The most step inputs per cache that attend by the kernel: it reads every key once for all of them, where PyTorch's
# flash attention is faster only for long prompt chunks (BENCHMARKS.md, "Attention of a step").
STEP_KERNEL_MAX_QUERIES = 64
# Prefill chunks: long where the chunk attends causally without a mask (the causal kernel skips more of the blocks
# above the diagonal in one long chunk than in several short ones), short where a mask is needed (its memory).
CAUSAL_CHUNK, MASKED_CHUNK = 2048, 512


def _interleave_rotary_pairs(rows: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """A query or key projection's output rows (weight or bias) reordered within each head from Llama's halves
    (x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}) to pairs (x_0, y_0, x_1, y_1, ...): RoPE then rotates each pair as one
    complex number, one multiplication for all heads. Queries and keys are permuted alike, so their dot products,
    and attention, are unchanged."""
    order = torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)
    return rows.reshape(heads, head_dim, -1)[:, order].reshape(rows.shape)


def _prefix_then_causal(query: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
                        keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of a prefill chunk: over the cached prefix (no mask) and causally over the chunk itself, merged by
    their log-sum-exps. Twice as fast on a CPU as one pass with a [q, prefix + q] mask at 4k tokens of context, where
    the masked kernel can skip no block and reads the mask."""
    out, lse = _FLASH_CPU(query, keys, values, is_causal=True)
    if prefix_keys.shape[2] == 0:
        return out
    prefix_out, prefix_lse = _FLASH_CPU(query, prefix_keys, prefix_values)
    total = torch.logaddexp(lse, prefix_lse)
    merged = out * torch.exp(lse - total)[..., None] + prefix_out * torch.exp(prefix_lse - total)[..., None]
    return merged.to(query.dtype)


class _GreedyHead:
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

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        logits = self.bf16(h).float()
        err = torch.outer(self.C * h.norm(dim=-1), self.row_norms).add_(1e-6)  # 1e-6: products flushed to zero
        top = logits.max(-1, keepdim=True)
        rows, cols = (logits + err >= top.values - err.gather(-1, top.indices)).nonzero(as_tuple=True)
        logits[rows, cols] = (h[rows] * self.weight[cols]).sum(-1)
        return logits.view(*hidden.shape[:-1], -1)


@dataclass
class StepOutput:
    """Result of one forward pass over [B, q] input tokens."""

    logits: torch.Tensor  # [B, q, V] (prefill: [B, 1, V], at each row's last new token)
    aux_hidden: torch.Tensor | None = None  # [B, q, 3H]: inputs of the aux_layer_ids layers, concatenated
    final_hidden: torch.Tensor | None = None  # [B, q, H]: the final hidden state after the model's last norm
    # prefill(hidden_tail=n): per row, the last min(n, new tokens) rows of aux and final hidden states
    hidden_tail: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def with_rows(self, other: "StepOutput", rows: torch.Tensor) -> "StepOutput":
        """This output with the rows where `rows` [B] is True taken from `other`."""
        def pick(mine, theirs):
            return None if mine is None else torch.where(rows[:, None, None], theirs, mine)

        return StepOutput(pick(self.logits, other.logits), pick(self.aux_hidden, other.aux_hidden),
                          pick(self.final_hidden, other.final_hidden))


@dataclass
class ForwardPart:
    """One cache's rows in a forward pass: [b, q] input tokens at slots lengths[r] + i of its rows. The parts of a pass
    may differ in q (a prefill chunk beside decode steps): their linear layers run over all their inputs at once, packed
    without padding, and each part attends over its own cache.

    depths [b, q]: each input's position offset from its row's length (a chain: 0..q-1; a tree: node depth).
    tree_mask [b, q, q] bool: input i attends to input j of the same row (ancestor-or-self; padding: self only).
    causal: every row's inputs are q consecutive tokens (a prefill chunk, no padding): tree_mask is causal.
    output_index [b, n]: outputs (logits, hidden states) at these n inputs of each row only (None: at every input;
    n = 0: none, a prefill chunk whose outputs nobody reads).
    tail_index [m] (one row): the hidden states at these inputs too, as the output's hidden_tail (a drafter's prompt
    context, from a prompt chunk).
    causal_rows (one row): its first causal_rows inputs are consecutive tokens (a prompt chunk before a draft tree):
    they attend causally without a mask, the rest by tree_mask; the mask then spans the rest only.
    """

    cache: KVCache
    tokens: torch.Tensor
    depths: torch.Tensor
    tree_mask: torch.Tensor
    causal: bool = False
    output_index: torch.Tensor | None = None
    tail_index: torch.Tensor | None = None
    causal_rows: int = 0


@dataclass
class StepInput:
    """One cache's part of a verification pass (`TargetModel.step_many`): row r gets [last_tokens[r]] + drafts[r]
    (a tree when parents[r] is given). prompt: a one-row cache's uncached prompt tokens, run first in the same row (a
    prefill chunk; they go into the cache); with no last token the part is that chunk alone. prompt_tail: the hidden
    states at the prompt's last prompt_tail tokens come back as the output's hidden_tail (with return_hidden)."""

    cache: KVCache
    last_tokens: Sequence[int]
    drafts: Sequence[Sequence[int]] = ()
    parents: Sequence[Sequence[int] | None] | None = None
    prompt: Sequence[int] = ()
    prompt_tail: int = 0


@dataclass
class _Attention:
    """How one cache's rows of a forward pass attend: their positions' rotary rows, their mask over the cache."""

    cache: KVCache
    kv_len: int
    mask: torch.Tensor | None  # [b, 1, heads per KV head * q, kv_len] (additive on a CPU); None: every input sees all
    slots: torch.Tensor  # [b, q]: where each input's key and value go
    start: int | None  # every row has this length: the inputs go to one slice of slots
    causal_chunk: bool  # rows of equal length whose q inputs are consecutive: attend in two mask-free parts
    causal_rows: int = 0  # one row: its first inputs attend as a causal chunk, the others by `mask` (theirs only)
    # The step kernel's inputs (`hybridspec.model._attention`) where it runs instead of `mask`: per row the keys every
    # input
    # sees ([b] int64), which of the step's own keys each input sees ([b, q, q] uint8), a scratch for the scores
    kernel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class _Layer:
    """One decoder layer's weights in the layout the fused forward uses."""

    __slots__ = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")

    def __init__(self, layer, pack: bool, heads: int, kv_heads: int, head_dim: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        # One matrix for Q, K and V (and one for gate and up): fewer, larger matmuls per layer.
        weights = [_interleave_rotary_pairs(attn.q_proj.weight, heads, head_dim),
                   _interleave_rotary_pairs(attn.k_proj.weight, kv_heads, head_dim), attn.v_proj.weight]
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        bias = None
        if all(b is not None for b in biases):
            bias = torch.cat([_interleave_rotary_pairs(biases[0], heads, head_dim),
                              _interleave_rotary_pairs(biases[1], kv_heads, head_dim), biases[2]])
        self.qkv = Linear(torch.cat(weights), bias, pack)
        self.o = Linear(attn.o_proj.weight, pack=pack)
        self.gate_up = Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), pack=pack)
        self.down = Linear(mlp.down_proj.weight, pack=pack)


class TargetModel:
    """A Llama-family transformers model run with a static KV cache, tree attention and hidden-state capture."""

    def __init__(self, model, max_seq_len: int | None = None, pack_weights: bool = True, tune: bool = True):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (Llama-family models use silu)")
        if config.model_type == "mistral" and getattr(config, "sliding_window", None):
            raise ValueError("sliding-window attention is not supported")
        self.model = model
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_seq_len = int(max_seq_len or config.max_position_embeddings)
        self.eps = config.rms_norm_eps
        self.aux_layer_ids = default_aux_layer_ids(self.num_layers) if self.num_layers >= 4 else ()
        decoder = model.model
        self.dtype = decoder.embed_tokens.weight.dtype
        self.device = decoder.embed_tokens.weight.device
        self._cpu_flash = _FLASH_CPU is not None and self.device.type == "cpu"
        # A step's attention (not a prompt chunk's) runs our CPU kernel where it can (see STEP_KERNEL_MAX_QUERIES)
        self._step_kernel = (_step_attention is not None and self.device.type == "cpu" and self.dtype == torch.float32
                             and self.head_dim in (16, 32, 64, 128) and _step_attention.supported())
        # The longest prompt chunk a step with a draft tree runs in one pass: where the chunk attends causally apart
        # (`ForwardPart.causal_rows`) the mask spans the tree alone; elsewhere it spans the chunk too.
        self.tree_prompt_chunk = CAUSAL_CHUNK if self._cpu_flash else MASKED_CHUNK
        with torch.no_grad():
            self.embed = decoder.embed_tokens.weight
            self.layers = [_Layer(layer, pack_weights, self.num_heads, self.num_kv_heads, self.head_dim)
                           for layer in decoder.layers]
            self.final_norm = decoder.norm.weight
            self.lm_head = Linear(model.get_output_embeddings().weight, pack=pack_weights)
            self.greedy_head = _GreedyHead(model.get_output_embeddings().weight) \
                if pack_weights and self.dtype == torch.float32 and self.device.type == "cpu" and fast_bf16() else None
            if pack_weights and tune:  # each product's kernel and rows as this machine runs them fastest
                tune_products(self.linears())
            # The rotary table for every position, computed once by the model's own rotary module (any RoPE scaling),
            # as one complex number per pair of dimensions (see _interleave_rotary_pairs).
            positions = torch.arange(self.max_seq_len, device=self.device)[None]
            cos, sin = (t[0].float() for t in decoder.rotary_emb(self.embed[:1][None], positions))
            half = self.head_dim // 2
            if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
                raise ValueError("rotary tables whose two halves differ are not supported")
            self.rope = torch.complex(cos[:, :half], sin[:, :half])  # [max_seq_len, head_dim / 2]

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "smollm2", dtype: torch.dtype = torch.float32,
                        max_seq_len: int | None = None, pack_weights: bool = True,
                        tune: bool = True) -> "TargetModel":
        from hybridspec.model.loading import load_model

        return cls(load_model(name_or_path, dtype=dtype), max_seq_len=max_seq_len, pack_weights=pack_weights,
                   tune=tune)

    def linears(self) -> list[Linear]:
        """Every product of a forward pass, in the order a pass runs them."""
        products = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return products + [self.lm_head] + ([self.greedy_head.bf16] if self.greedy_head is not None else [])

    def new_cache(self, batch_size: int = 1, capacity: int = 1024) -> KVCache:
        return KVCache(self.num_layers, batch_size, self.num_kv_heads, self.head_dim,
                       min(capacity, self.max_seq_len), self.dtype, self.device)

    # ------------------------------------------------------------------------------------------------------------
    # forward

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's own op: fewer dispatches, bitwise equal (tests/test_target.py)
            return torch.rms_norm(x, weight.shape, weight, self.eps)
        inverse_rms = x.float().pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x.float() * inverse_rms).to(x.dtype) * weight

    @staticmethod
    def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """RoPE on x [..., head_dim] in pair order (see _interleave_rotary_pairs); rope [..., head_dim / 2] complex."""
        if x.dtype != torch.float32:
            return TargetModel._rotate(x.float(), rope).to(x.dtype)
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rope).flatten(-2)

    def _attention(self, cache: KVCache, depths: torch.Tensor, tree_mask: torch.Tensor, causal: bool,
                   causal_rows: int = 0) -> _Attention:
        """The attention mask and KV slots of one cache's rows in a pass (grows the cache if the inputs need it)."""
        bsz, q = depths.shape
        causal_rows = causal_rows if self._cpu_flash and bsz == 1 and not causal else 0
        lengths = torch.tensor(cache.lengths, dtype=torch.long, device=self.device)
        kv_len = max(cache.lengths) + q
        if kv_len > self.max_seq_len:
            raise ValueError(f"sequence length {kv_len} exceeds the model's context of {self.max_seq_len} tokens")
        cache.reserve(kv_len)
        slots = lengths[:, None] + torch.arange(q, device=self.device)  # [B, q]
        same_length = all(n == cache.lengths[0] for n in cache.lengths)
        causal_chunk = causal and same_length and self._cpu_flash
        if not causal_chunk and self._step_kernel and q - causal_rows <= STEP_KERNEL_MAX_QUERIES:
            steps = q - causal_rows
            see = tree_mask[:, causal_rows:, causal_rows:].to(torch.uint8).contiguous()
            scores = torch.empty(self.num_heads // self.num_kv_heads * steps * (kv_len + 16), dtype=torch.float32)
            return _Attention(cache, kv_len, None, slots, cache.lengths[0] if same_length else None, False,
                              causal_rows, (lengths + causal_rows, see, scores))
        # mask[b, 0, i, j]: committed prefix of row b, then the row's own tree block at its slots.
        mask = torch.arange(kv_len, device=self.device)[None, None, :] < lengths[:, None, None]
        mask = mask.expand(bsz, q, kv_len).clone()
        row_ids = torch.arange(bsz, device=self.device)[:, None, None]
        mask[row_ids, torch.arange(q, device=self.device)[None, :, None], slots[:, None, :]] = tree_mask
        folded_mask = None
        mask = mask[:, causal_rows:]  # rows of a causal chunk need none
        if not causal_chunk and not bool(mask.all()):
            # Row r of a folded head is input r % q (see _attend); CPU flash attention takes an additive mask.
            folded = mask[:, None].repeat(1, 1, self.num_heads // self.num_kv_heads, 1)
            folded_mask = folded if not self._cpu_flash else \
                torch.zeros(folded.shape, dtype=self.dtype, device=self.device).masked_fill_(~folded, float("-inf"))
        return _Attention(cache, kv_len, folded_mask, slots, cache.lengths[0] if same_length else None, causal_chunk,
                          causal_rows)

    def _attend(self, g: _Attention, layer_id: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        """Write one cache's new keys and values ([b, kv_heads, q, D]) at their slots, and attend over the cache."""
        keys, values = g.cache.keys[layer_id], g.cache.values[layer_id]
        q = key.shape[2]
        if g.start is not None:
            keys[:, :, g.start:g.start + q] = key
            values[:, :, g.start:g.start + q] = value
        else:
            # Advanced indices split by a slice put their dims first: the target view is [B, q, kv_heads, D].
            row_ids = torch.arange(key.shape[0], device=self.device)[:, None]
            keys[row_ids, :, g.slots] = key.transpose(1, 2)
            values[row_ids, :, g.slots] = value.transpose(1, 2)
        if g.causal_chunk:
            return _prefix_then_causal(query, keys[:, :, :g.start], values[:, :, :g.start], key, value)
        if g.causal_rows:  # a prompt chunk, then a draft tree that sees all of it
            n = g.causal_rows
            chunk = _prefix_then_causal(query[:, :, :n], keys[:, :, :g.start], values[:, :, :g.start], key[:, :, :n],
                                        value[:, :, :n])
            return torch.cat([chunk, self._attend_masked(g, keys, values, query[:, :, n:])], dim=2)
        return self._attend_masked(g, keys, values, query)

    def _attend_masked(self, g: _Attention, keys: torch.Tensor, values: torch.Tensor,
                       query: torch.Tensor) -> torch.Tensor:
        """Attention of `query` [b, heads, q, D] over the cache's first kv_len slots, by g.mask."""
        # The query heads that share a KV head attend as the rows of one head, so each KV head is read once per step
        # rather than once per query head (BENCHMARKS.md, "Verification cost on this CPU").
        bsz, _, q, head_dim = query.shape
        folded = query.reshape(bsz, self.num_kv_heads, self.num_heads // self.num_kv_heads * q, head_dim)
        if g.kernel is not None:
            prefix, see, scores = g.kernel
            folded, out = folded.contiguous(), torch.empty_like(folded)
            _step_attention.decode_attention(
                folded.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), scores.data_ptr(), bsz,
                self.num_kv_heads, folded.shape[2], head_dim, q, prefix.data_ptr(), see.data_ptr(), keys.stride(0),
                keys.stride(1), keys.stride(2), head_dim ** -0.5)
            return out.view(bsz, self.num_heads, q, head_dim)
        keys, values = keys[:, :, :g.kv_len], values[:, :, :g.kv_len]
        if self._cpu_flash:
            out = _FLASH_CPU(folded, keys, values, attn_mask=g.mask)[0]
        else:
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=g.mask)
        return out.view(bsz, self.num_heads, q, head_dim)

    @torch.inference_mode()
    def forward(self, parts: Sequence[ForwardPart], *, return_hidden: bool = False,
                hidden_at_every_input: bool = False, argmax_only: bool = False) -> list[StepOutput]:
        """Run every part's inputs in one pass (`ForwardPart`); does not change the rows' lengths. One output per part:
        [b, n, ...] at its output_index (n = q without one).

        Concurrent calls share the pass: the linear layers, where a decode step spends its time reading weights, run
        once for all of them. hidden_at_every_input keeps the hidden states at every input all the same (what a drafter
        reads of a prompt). argmax_only: the logits need to be right only where they are their row's maximum (greedy
        verification), which a small pass gets sooner (`_GreedyHead`).
        """
        groups, positions, spans, begin = [], [], [], 0
        for part in parts:
            b, q = part.tokens.shape
            if part.cache.batch_size != b:
                raise ValueError(f"{b} input rows for a cache of {part.cache.batch_size} rows")
            groups.append(self._attention(part.cache, part.depths, part.tree_mask, part.causal, part.causal_rows))
            lengths = torch.tensor(part.cache.lengths, dtype=torch.long, device=self.device)
            positions.append((lengths[:, None] + part.depths).reshape(-1))
            spans.append((begin, begin + b * q))
            begin += b * q
        total = begin
        rope = self.rope[torch.cat(positions)][:, None]  # [T, 1, D / 2]

        hq, hk, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed[torch.cat([p.tokens.reshape(-1) for p in parts])]  # [T, H], every part's inputs packed
        layer_inputs = {}
        for layer_id, layer in enumerate(self.layers):
            if return_hidden and layer_id in self.aux_layer_ids:
                layer_inputs[layer_id] = x
            qkv = layer.qkv(self._rms_norm(x, layer.input_norm))
            query_key = self._rotate(qkv[:, :(hq + hk) * hd].view(total, hq + hk, hd), rope)
            attn = []
            for part, g, (lo, hi) in zip(parts, groups, spans):
                b, q = part.tokens.shape
                qk = query_key[lo:hi].view(b, q, hq + hk, hd)
                value = qkv[lo:hi, (hq + hk) * hd:].view(b, q, hk, hd).transpose(1, 2)
                out = self._attend(g, layer_id, qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2), value)
                attn.append(out.transpose(1, 2).reshape(b * q, hq * hd))
            x = layer.o.plus(attn[0] if len(attn) == 1 else torch.cat(attn), x)
            gate, up = layer.gate_up(self._rms_norm(x, layer.post_norm)).chunk(2, dim=-1)
            x = layer.down.plus(F.silu(gate) * up, x)

        # Which inputs give outputs, as indices into the packed inputs (None: all of them, no gather).
        shapes = [p.tokens.shape if p.output_index is None else p.output_index.shape for p in parts]
        picked = None
        if any(p.output_index is not None for p in parts):
            picked = torch.cat([
                torch.arange(lo, hi, device=self.device) if p.output_index is None else
                (lo + torch.arange(p.tokens.shape[0], device=self.device)[:, None] * p.tokens.shape[1]
                 + p.output_index).reshape(-1) for p, (lo, hi) in zip(parts, spans)])
        pick = (lambda h: h) if picked is None else (lambda h: h[picked])
        hidden_pick = (lambda h: h) if hidden_at_every_input else pick
        final = self._rms_norm(hidden_pick(x), self.final_norm)
        final_out = pick(final) if hidden_at_every_input else final
        greedy = argmax_only and self.greedy_head is not None and final_out.shape[0] <= _GreedyHead.MAX_ROWS
        if final_out.shape[0]:
            logits = (self.greedy_head if greedy else self.lm_head)(final_out)
        else:  # prompt chunks alone: no outputs
            logits = final_out.new_zeros(0, self.vocab_size)
        aux = None
        if return_hidden:
            aux = torch.cat([hidden_pick(layer_inputs[i]) for i in self.aux_layer_ids], dim=-1) \
                if self.aux_layer_ids else None
        hidden_shapes = [p.tokens.shape for p in parts] if hidden_at_every_input else shapes

        def split(t: torch.Tensor | None, sizes) -> list[torch.Tensor | None]:
            if t is None:
                return [None] * len(parts)
            bounds = [0, *itertools.accumulate(b * n for b, n in sizes)]
            return [t[lo:hi].view(b, n, t.shape[-1]) for (lo, hi), (b, n) in zip(zip(bounds, bounds[1:]), sizes)]

        if not return_hidden:
            return [StepOutput(lg) for lg in split(logits, shapes)]
        outs = [StepOutput(lg, a, f) for lg, a, f in zip(split(logits, shapes), split(aux, hidden_shapes),
                                                         split(final, hidden_shapes))]
        for out, part, (lo, _) in zip(outs, parts, spans):
            if part.tail_index is not None:
                rows = lo + part.tail_index
                tail_aux = torch.cat([layer_inputs[i][rows] for i in self.aux_layer_ids], dim=-1)
                out.hidden_tail = [(tail_aux, self._rms_norm(x[rows], self.final_norm))]
        return outs

    # ------------------------------------------------------------------------------------------------------------
    # prefill and verification steps

    def prefill(self, cache: KVCache, tokens: Sequence[Sequence[int]], *, chunk_size: int | None = None,
                return_hidden: bool = False, hidden_tail: int = 0, logits_tail: int = 1,
                argmax_only: bool = False) -> StepOutput:
        """Append tokens[b] to row b of the cache, for all rows in one batched pass per chunk; a row may get none.

        Returns the output at each row's last new token ([B, 1, ...]; meaningless for rows that got none; one row
        only: logits_tail=n gives the logits at its last n tokens, [1, n, V]), and with hidden_tail=n the hidden
        states at each row's last min(n, len(tokens[b])) new tokens (a drafter's context). Rows are padded to the
        longest; chunks (of chunk_size tokens; default CAUSAL_CHUNK where every row has the same length and gets as
        many tokens on a CPU, else MASKED_CHUNK) bound the attention mask's memory. argmax_only: as in `forward`.
        """
        if len(tokens) != cache.batch_size:
            raise ValueError(f"got tokens for {len(tokens)} rows for a cache of {cache.batch_size}")
        counts = [len(t) for t in tokens]
        if max(counts, default=0) == 0:
            raise ValueError("prefill needs at least one token")
        longest = max(n + counts[b] for b, n in enumerate(cache.lengths))
        if longest > self.max_seq_len:
            raise ValueError(f"{longest} tokens exceed the model's context of {self.max_seq_len} tokens")
        for t in tokens:
            if t and not 0 <= min(t) <= max(t) < self.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        if logits_tail != 1 and (len(tokens) != 1 or not 1 <= logits_tail <= counts[0] or hidden_tail or return_hidden):
            raise ValueError("logits_tail needs one row of at least that many tokens, and no hidden states")
        cache.reserve(longest)
        if chunk_size is None:
            uniform = len(set(counts)) == 1 and len(set(cache.lengths)) == 1
            chunk_size = CAUSAL_CHUNK if uniform and self._cpu_flash else MASKED_CHUNK
        bsz, out = cache.batch_size, None
        last = torch.zeros(bsz, dtype=torch.long)
        tails: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(bsz)]
        begins = list(range(0, max(counts), chunk_size))
        if len(begins) > 1 and max(counts) - begins[-1] < logits_tail:
            del begins[-1]  # the logits' tokens share the last chunk (a little longer than chunk_size)
        for begin, end in zip(begins, begins[1:] + [max(counts)]):
            chunks = [list(t[begin:end]) for t in tokens]
            q = max(len(c) for c in chunks)
            ids = torch.zeros(bsz, q, dtype=torch.long)
            # causal within each row's chunk; padding slots see only themselves
            mask = torch.eye(q, dtype=torch.bool).repeat(bsz, 1, 1)
            for b, chunk in enumerate(chunks):
                ids[b, :len(chunk)] = torch.as_tensor(chunk, dtype=torch.long)
                mask[b, :len(chunk), :len(chunk)] = torch.ones(len(chunk), len(chunk), dtype=torch.bool).tril()
                if chunk:
                    last[b] = len(chunk) - 1
            part = ForwardPart(cache, ids.to(self.device), torch.arange(q, device=self.device).expand(bsz, q),
                               mask.to(self.device), causal=all(len(c) == q for c in chunks),
                               output_index=(last[:, None] + torch.arange(1 - logits_tail, 1)).to(self.device))
            step = self.forward([part], return_hidden=return_hidden or hidden_tail > 0,
                                hidden_at_every_input=hidden_tail > 0, argmax_only=argmax_only)[0]
            if hidden_tail > 0:
                for b, chunk in enumerate(chunks):
                    skip = max(0, counts[b] - hidden_tail - begin)  # row b's inputs begin.. in this chunk
                    if skip < len(chunk):
                        tails[b].append((step.aux_hidden[b, skip:len(chunk)], step.final_hidden[b, skip:len(chunk)]))
                rows = torch.arange(bsz, device=self.device)
                step = StepOutput(step.logits, step.aux_hidden[rows, last][:, None],
                                  step.final_hidden[rows, last][:, None])
            ends_here = [bool(c) and begin + len(c) == n for c, n in zip(chunks, counts)]
            out = step if out is None else out.with_rows(step, torch.tensor(ends_here, device=self.device))
            for b, chunk in enumerate(chunks):
                cache.lengths[b] += len(chunk)
        if hidden_tail > 0:
            width_aux, width = out.aux_hidden.shape[-1], out.final_hidden.shape[-1]
            out.hidden_tail = [(torch.cat([a for a, _ in parts]) if parts else out.aux_hidden.new_zeros(0, width_aux),
                                torch.cat([f for _, f in parts]) if parts else out.final_hidden.new_zeros(0, width))
                               for parts in tails]
        return out

    def step(self, cache: KVCache, last_tokens: Sequence[int], drafts: Sequence[Sequence[int]] | None = None,
             parents: Sequence[Sequence[int] | None] | None = None, *, return_hidden: bool = False,
             argmax_only: bool = False) -> StepOutput:
        """One verification pass: row b gets [last_tokens[b]] + drafts[b] (a tree when parents[b] is given).

        Returns logits [B, q, V] where q = 1 + the longest draft; rows with shorter drafts are padded (padding slots
        see only themselves and their outputs are meaningless). Lengths are unchanged: call `cache.commit` after
        verification with the slots to keep. argmax_only: only each row's argmax of the logits is needed (greedy).
        """
        return self.step_many([StepInput(cache, last_tokens, drafts or (), parents)], return_hidden=return_hidden,
                              argmax_only=argmax_only)[0]

    def step_many(self, inputs: Sequence[StepInput], *, return_hidden: bool = False,
                  argmax_only: bool = False) -> list[StepOutput]:
        """`step` for several caches in one pass; an output per input, of the inputs [last token] + draft (none for a
        prefill chunk alone). An input's prompt tokens go into its cache."""
        parts = [self._step_part(i) for i in inputs]
        outs = self.forward(parts, return_hidden=return_hidden, argmax_only=argmax_only)
        for i in inputs:
            i.cache.lengths[0] += len(i.prompt)
        return outs

    def _step_part(self, step: StepInput) -> ForwardPart:
        """A StepInput's rows: [prompt] + [last token] + draft, padded to the longest row (padding sees only itself)."""
        cache, prompt = step.cache, list(step.prompt)
        if len(step.last_tokens) != cache.batch_size and not (prompt and not step.last_tokens):
            raise ValueError(f"got {len(step.last_tokens)} rows for a cache of {cache.batch_size}")
        if prompt and cache.batch_size != 1:
            raise ValueError(f"prompt tokens go with a one-row cache, got {cache.batch_size} rows")
        drafts = [list(d) for d in step.drafts] if step.drafts else [[] for _ in step.last_tokens]
        parents = list(step.parents) if step.parents is not None else [None] * len(drafts)
        if not len(drafts) == len(parents) == len(step.last_tokens):
            raise ValueError(f"{len(step.last_tokens)} rows, {len(drafts)} drafts, {len(parents)} parent lists")
        width = len(prompt)
        q = width + (1 + max(map(len, drafts)) if drafts else 0)
        rows = max(1, len(drafts))
        tokens = torch.zeros(rows, q, dtype=torch.long)
        depths = torch.zeros(rows, q, dtype=torch.long)
        tree_mask = torch.eye(q, dtype=torch.bool).repeat(rows, 1, 1)
        if prompt:  # the prompt's chunk is causal, and every step input sees all of it
            tokens[0, :width] = torch.as_tensor(prompt, dtype=torch.long)
            depths[0, :width] = torch.arange(width)
            tree_mask[0, :, :width] = torch.ones(q, width, dtype=torch.bool).tril()
        causal = True
        for b, (last, draft, row_parents) in enumerate(zip(step.last_tokens, drafts, parents)):
            n = len(draft)
            chain = row_parents is None or list(row_parents) == list(range(-1, n - 1))
            row_parents = list(row_parents) if row_parents is not None else list(range(-1, n - 1))
            if len(row_parents) != n:
                raise ValueError(f"row {b}: {n} draft tokens but {len(row_parents)} parents")
            causal = causal and chain and width + 1 + n == q
            depth, mask = tree_depths_and_mask(row_parents)
            tokens[b, width] = int(last)
            tokens[b, width + 1:width + n + 1] = torch.as_tensor(draft, dtype=torch.long)
            depths[b, width:width + n + 1] = width + torch.as_tensor(depth)
            tree_mask[b, width:width + n + 1, width:width + n + 1] = mask
        if int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        if not 0 <= step.prompt_tail <= width:
            raise ValueError(f"prompt_tail {step.prompt_tail} for a prompt chunk of {width} tokens")
        output_index = torch.arange(width, q)[None].expand(rows, q - width) if prompt else None
        return ForwardPart(cache, tokens.to(self.device), depths.to(self.device), tree_mask.to(self.device),
                           causal=causal and bool(prompt),  # a step alone attends by its mask (_attend's folding)
                           causal_rows=width if prompt and not causal else 0,
                           output_index=None if output_index is None else output_index.to(self.device),
                           tail_index=torch.arange(width - step.prompt_tail, width, device=self.device)
                           if step.prompt_tail else None)
