"""The attention of a target forward pass, for one cache's rows at a time: rotary position embedding (as one complex
multiplication per pair of dimensions), then where each input's key and value go in the KV cache and which keys it
sees, and the attention itself by the fastest route for the inputs at hand. A decode or verification step (a few
queries per row, chains, trees and rows of different lengths) runs the AVX-512 kernel `hybridspec.model._attention`
on a CPU that has it; a prompt chunk attends to the cached prefix and causally to itself by the same module's flash
kernel for prompts (its tiles split over torch's threads), or without it by PyTorch's CPU flash attention in two
mask-free parts merged by their log-sum-exps; anything else (another device, no kernel) attends under one boolean or
additive mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from hybridspec.model.kv_cache import KVCache

# PyTorch's CPU flash attention, which also returns the log-sum-exp of each query's scores (GQA without repeats).
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
try:  # the attention kernels of steps and prompt chunks on a CPU (built with the package; AVX-512 CPUs)
    from hybridspec.model import _attention as _kernels
except ImportError:  # pragma: no cover - a build without it: PyTorch's attention throughout
    _kernels = None
# The most step inputs per cache that attend by the kernel. It reads every key once for all of a step's queries, which
# wins while they are few; flash attention, built for many query rows, is faster only for long prompt chunks
# (`benchmarks/bench_attention.py` measures both by number of queries).
STEP_KERNEL_MAX_QUERIES = 64


def interleave_rotary_pairs(rows: torch.Tensor, heads: int, head_dim: int,
                            rotary_dim: int | None = None) -> torch.Tensor:
    """A query or key projection's output rows (weight or bias) reordered within each head from Llama's halves
    (x_0 .. x_{r/2-1}, y_0 .. y_{r/2-1}, then the head_dim - r dimensions RoPE leaves alone; r = rotary_dim, all of
    them by default) to pairs (x_0, y_0, x_1, y_1, ..., then the others as they are): RoPE then rotates each pair as
    one complex number, one multiplication for all heads (the others by 1). Queries and keys are permuted alike, so
    their dot products, and attention, are unchanged."""
    rotary_dim = rotary_dim or head_dim
    order = torch.cat([torch.arange(rotary_dim).view(2, rotary_dim // 2).t().reshape(-1),
                       torch.arange(rotary_dim, head_dim)])
    return rows.reshape(heads, head_dim, -1)[:, order].reshape(rows.shape)


def rotary_table(rotary_emb, like: torch.Tensor, max_seq_len: int, head_dim: int,
                 rotary_dim: int | None = None) -> torch.Tensor:
    """[max_seq_len, head_dim / 2] complex: the rotation of every position, computed once by the model's own rotary
    module (so any RoPE scaling it applies holds, YaRN's magnitude too), one complex number per pair of dimensions;
    1 for the pairs past rotary_dim (partial RoPE). like: [1, 1, H], a tensor of the model's dtype and device. The
    module gives both halves (Llama) or one (gpt-oss)."""
    positions = torch.arange(max_seq_len, device=like.device)[None]
    cos, sin = (t[0].float() for t in rotary_emb(like, positions))
    half = (rotary_dim or head_dim) // 2
    if cos.shape[-1] != half:
        if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
            raise ValueError("rotary tables whose two halves differ are not supported")
        cos, sin = cos[:, :half], sin[:, :half]
    table = torch.complex(cos, sin)
    if half < head_dim // 2:
        table = torch.cat([table, table.new_ones(max_seq_len, head_dim // 2 - half)], dim=-1)
    return table


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., head_dim] in pair order (see interleave_rotary_pairs); rope [..., head_dim / 2] complex."""
    if x.dtype != torch.float32:
        return rotate(x.float(), rope).to(x.dtype)
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rope).flatten(-2)


def _prefix_then_causal(query: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
                        keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a prefill chunk: over the cached prefix (no mask) and causally over the chunk itself, merged by
    their log-sum-exps. Twice as fast on a CPU as one pass with a [q, prefix + q] mask at 4k tokens of context, where
    the masked kernel can skip no block and reads the mask. sinks: [heads], as `with_sinks`."""
    out, lse = FLASH_CPU(query, keys, values, is_causal=True)[:2]
    if prefix_keys.shape[2] != 0:
        prefix_out, prefix_lse = FLASH_CPU(query, prefix_keys, prefix_values)[:2]
        total = torch.logaddexp(lse, prefix_lse)
        out = out * torch.exp(lse - total)[..., None] + prefix_out * torch.exp(prefix_lse - total)[..., None]
        lse = total
    return (out if sinks is None else with_sinks(out, lse, sinks[:, None])).to(query.dtype)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink (gpt-oss): one more logit per head, `sinks`, in the softmax's denominator and no value.
    The softmax over keys alone (out, and its log-sum-exp lse [..., rows]) scaled by sum / (sum + e^sink)."""
    return out * torch.sigmoid(lse - sinks)[..., None]


def _prompt_kernel(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   num_kv_heads: int, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Attention of a prompt chunk by the kernel (`hs_prefill_attention`): query [b, heads, q, D] (any strides, D
    contiguous: the projection's transposed view is read in place) at positions start.., each seeing the cache up to
    itself (its own keys already written there; keys [b, kv_heads, capacity, D]; sinks [heads] float32 contiguous,
    or None), or only its last `window` positions (0: all; else at least TILE_QUERIES). Its tiles (16 queries of a
    KV head) are dealt over torch's threads. Returns [b, heads, q, D], a view of [b, q, heads, D] memory: the output
    projection's input without a copy."""
    bsz, heads, q, dim = query.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = query.new_empty(bsz, q, heads, dim).transpose(1, 2)
    tiles = bsz * num_kv_heads * -(-q // _kernels.TILE_QUERIES)
    workers = min(torch.get_num_threads(), tiles)
    group = heads // num_kv_heads
    scratch = torch.empty(workers, 16 * group * (2 * dim + _kernels.TILE_KEYS + 2))
    _kernels.prefill_attention(query.data_ptr(), query.stride()[:3], keys.data_ptr(), values.data_ptr(),
                               out.data_ptr(), out.stride()[:3], scratch.data_ptr(), scratch.shape[1], num_kv_heads,
                               group, q, dim, start, tiles, _address(sinks), window, keys.stride(0), keys.stride(1),
                               keys.stride(2), dim ** -0.5, workers)
    return out


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@dataclass
class AttentionPlan:
    """How one cache's rows of a forward pass attend: their slots in the cache, their mask over it."""

    cache: KVCache
    kv_len: int
    mask: torch.Tensor | None  # [b, 1, heads per KV head * q, kv_len] (additive on a CPU); None: every input sees all
    slots: torch.Tensor  # [b, q]: where each input's key and value go
    start: int | None  # every row has this length: the inputs go to one slice of slots
    causal_chunk: bool  # rows of equal length whose q inputs are consecutive: attend in two mask-free parts
    causal_rows: int = 0  # one row: its first inputs attend as a causal chunk, the others by `mask` (theirs only)
    # The step kernel's inputs (`hybridspec.model._attention`) where it runs instead of `mask`: per row the keys every
    # input sees ([b] int64), which of the step's own keys each input sees ([b, q, q] uint8), each thread's scratch for
    # the scores
    kernel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ring: bool = False  # a sliding-window layer's: its keys and values in the cache's ring (`plan_ring`)
    window: int = 0  # a ring's prompt chunk that attends by the prompt kernel: the layer's window


@dataclass
class JoinedSteps:
    """Steps of several caches that attend in one kernel call per layer (`Attention.join_steps`): each of their rows
    as a row of the call, its cache's layer found by address."""

    parts: list[int]  # the parts of the pass, by index
    inputs: torch.Tensor  # [rows * q]: their inputs' places among the pass's packed inputs, row by row
    q: int
    key_rows: torch.Tensor  # [rows] int64: the address of each row's keys in layer 0
    value_rows: torch.Tensor
    layer_bytes: torch.Tensor  # [rows] int64: from one layer of the row's cache to the next
    head_strides: torch.Tensor  # [rows] int64, in floats
    prefix: torch.Tensor  # [rows] int64: the keys every input of the row sees
    see: torch.Tensor  # [rows, q, q] uint8: which of the step's own keys each input sees
    scores: torch.Tensor  # the kernel's scratch: [threads, floats]


class Attention:
    """The attention of one model's passes: `plan` a cache's rows once per pass, then `attend` in every layer.

    cpu_flash: prompt chunks attend in mask-free parts (on a CPU that has PyTorch's CPU flash attention).
    kernel: steps and prompt chunks attend by the AVX-512 kernels (float32 on a CPU that has them, head sizes they
    were built for); without them prompt chunks attend by PyTorch's CPU flash attention.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_seq_len: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.device, self.max_seq_len = dtype, device, max_seq_len
        self.cpu_flash = FLASH_CPU is not None and device.type == "cpu"
        self.kernel = (_kernels is not None and device.type == "cpu" and dtype == torch.float32
                       and head_dim in (16, 32, 64, 128) and _kernels.supported())

    def plan(self, cache: KVCache, depths: torch.Tensor, tree_mask: torch.Tensor, causal: bool,
             causal_rows: int = 0) -> AttentionPlan:
        """The attention mask and KV slots of one cache's rows in a pass (grows the cache if the inputs need it)."""
        bsz, q = depths.shape
        causal_rows = causal_rows if self.cpu_flash and bsz == 1 and not causal else 0
        lengths = torch.tensor(cache.lengths, dtype=torch.long, device=self.device)
        kv_len = max(cache.lengths) + q
        if kv_len > self.max_seq_len:
            raise ValueError(f"sequence length {kv_len} exceeds the model's context of {self.max_seq_len} tokens")
        cache.reserve(kv_len)
        slots = lengths[:, None] + torch.arange(q, device=self.device)  # [B, q]
        same_length = all(n == cache.lengths[0] for n in cache.lengths)
        causal_chunk = causal and same_length and self.cpu_flash
        group = self.num_heads // self.num_kv_heads
        if not causal_chunk and self.kernel and q - causal_rows <= STEP_KERNEL_MAX_QUERIES:
            steps = q - causal_rows
            see = tree_mask[:, causal_rows:, causal_rows:].to(torch.uint8).contiguous()
            scores = torch.empty(torch.get_num_threads(), group * steps * (kv_len + 16), dtype=torch.float32)
            return AttentionPlan(cache, kv_len, None, slots, cache.lengths[0] if same_length else None, False,
                                 causal_rows, (lengths + causal_rows, see, scores))
        mask = self._visible(lengths, slots, tree_mask, kv_len)[:, causal_rows:]  # rows of a causal chunk need none
        folded_mask = None if causal_chunk or bool(mask.all()) else self._fold(mask)
        return AttentionPlan(cache, kv_len, folded_mask, slots, cache.lengths[0] if same_length else None,
                             causal_chunk, causal_rows)

    def plan_ring(self, cache: KVCache, depths: torch.Tensor, tree_mask: torch.Tensor, window: int,
                  causal: bool = False) -> AttentionPlan:
        """The plan of one cache's rows in a sliding-window layer, whose keys and values are in the cache's ring
        (`RingShape`): each input goes to the slot of its place among the pass's inputs past its row's length, and
        sees, by position (a tree node's is its row's length plus its depth), the committed keys of the last `window`
        positions (itself included) and those of its own tree block within them. Attends under a mask over the ring's
        slots: attention does not depend on the order of its keys (they were rotated before they were stored); a
        prompt chunk of rows of one length (causal) by the prompt kernel, over the window's keys in position order."""
        bsz, q = depths.shape
        cache.reserve_inputs(q)
        size = cache.ring_size
        lengths = torch.tensor(cache.lengths, dtype=torch.long, device=self.device)[:, None]
        slots = (lengths + torch.arange(q, device=self.device)) % size  # [b, q]: where each input's key goes
        for row, length in enumerate(cache.lengths):
            cache.note_ring_writes(row, length + q)
        if causal and self.kernel and window >= _kernels.TILE_QUERIES and len(set(cache.lengths)) == 1:
            return AttentionPlan(cache, size, None, slots, cache.lengths[0], True, ring=True, window=window)
        positions = lengths + depths  # [b, q]
        # the committed position each slot holds (the last p < length with p % size == slot; negative: none yet)
        held = lengths - 1 - (lengths - 1 - torch.arange(size, device=self.device)) % size  # [b, size]
        mask = (held[:, None, :] >= 0) & (held[:, None, :] > positions[:, :, None] - window)  # [b, q, size]
        own = tree_mask & (positions[:, None, :] > positions[:, :, None] - window)  # [b, q, q]: own keys it sees
        rows = torch.arange(bsz, device=self.device)[:, None, None]
        mask[rows, torch.arange(q, device=self.device)[None, :, None], slots[:, None, :]] = own
        return AttentionPlan(cache, size, self._fold(mask), slots, None, False, ring=True)

    def _visible(self, lengths: torch.Tensor, slots: torch.Tensor, tree_mask: torch.Tensor,
                 kv_len: int) -> torch.Tensor:
        """[b, q, kv_len] bool: each input sees its row's committed prefix, then its own tree block at its slots."""
        bsz, q = slots.shape
        mask = torch.arange(kv_len, device=self.device)[None, None, :] < lengths[:, None, None]
        mask = mask.expand(bsz, q, kv_len).clone()
        row_ids = torch.arange(bsz, device=self.device)[:, None, None]
        mask[row_ids, torch.arange(q, device=self.device)[None, :, None], slots[:, None, :]] = tree_mask
        return mask

    def _fold(self, mask: torch.Tensor) -> torch.Tensor:
        """[b, q, kv_len] bool -> [b, 1, heads per KV head * q, kv_len]: row r of a folded head is input r % q (see
        _attend_masked); additive where CPU flash attention takes it."""
        folded = mask[:, None].repeat(1, 1, self.num_heads // self.num_kv_heads, 1)
        if not self.cpu_flash:
            return folded
        return torch.zeros(folded.shape, dtype=self.dtype, device=self.device).masked_fill_(~folded, float("-inf"))

    def join_steps(self, plans: Sequence[AttentionPlan], spans: Sequence[tuple[int, int]]) -> list[JoinedSteps]:
        """The parts of a pass that attend by the step kernel with the same number of inputs, joined where there are
        several (concurrent calls' steps, one cache each): one kernel call per layer for all of them, not one per
        cache with its own slicing and writes, which at 64 calls cost a tenth of a pass."""
        by_q: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            if plan.kernel is not None and not plan.causal_rows:
                by_q.setdefault(plan.kernel[1].shape[1], []).append(i)
        joined = []
        for q, parts in by_q.items():
            if len(parts) < 2:
                continue
            caches = [plans[i].cache for i in parts]
            item = caches[0].keys.element_size()
            rows = [(c, r) for c in caches for r in range(c.batch_size)]
            key_rows = [c.keys.data_ptr() + r * c.keys.stride(1) * item for c, r in rows]
            value_rows = [c.values.data_ptr() + r * c.values.stride(1) * item for c, r in rows]
            group = self.num_heads // self.num_kv_heads
            joined.append(JoinedSteps(
                parts, torch.cat([torch.arange(*spans[i]) for i in parts]), q,
                torch.tensor(key_rows, dtype=torch.int64), torch.tensor(value_rows, dtype=torch.int64),
                torch.tensor([c.keys.stride(0) * item for c, _ in rows], dtype=torch.int64),
                torch.tensor([c.keys.stride(2) for c, _ in rows], dtype=torch.int64),
                torch.cat([plans[i].kernel[0] for i in parts]), torch.cat([plans[i].kernel[1] for i in parts]),
                torch.empty(torch.get_num_threads(), group * q * (max(plans[i].kv_len for i in parts) + 16),
                            dtype=torch.float32)))
        return joined

    def attend_joined(self, steps: JoinedSteps, layer_id: int, query_key: torch.Tensor, value: torch.Tensor,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Joined steps' attention in one layer: their inputs' rotated queries and keys [n, heads + kv_heads, D] and
        values [n, kv_heads * D] in, the attention [n, heads * D] out; their new keys and values go to their caches.
        sinks: the layer's, as `attend`."""
        q, hq, hk, dim = steps.q, self.num_heads, self.num_kv_heads, self.head_dim
        rows = query_key.shape[0] // q
        query_key = query_key.view(rows, q, hq + hk, dim)
        folded = query_key[:, :, :hq].transpose(1, 2).reshape(rows, hk, hq // hk * q, dim).contiguous()
        keys = query_key[:, :, hq:].transpose(1, 2).contiguous()
        values = value.view(rows, q, hk, dim).transpose(1, 2).contiguous()
        out = torch.empty_like(folded)
        key_rows = steps.key_rows + layer_id * steps.layer_bytes
        value_rows = steps.value_rows + layer_id * steps.layer_bytes
        _kernels.decode_attention_rows(
            folded.data_ptr(), keys.data_ptr(), values.data_ptr(), key_rows.data_ptr(), value_rows.data_ptr(),
            steps.head_strides.data_ptr(), out.data_ptr(), steps.scores.data_ptr(), steps.scores.shape[1], rows, hk,
            folded.shape[2], dim, q, steps.prefix.data_ptr(), steps.see.data_ptr(), _address(sinks), dim, dim ** -0.5,
            steps.scores.shape[0])
        return out.view(rows, hq, q, dim).transpose(1, 2).reshape(rows * q, hq * dim)

    def attend(self, plan: AttentionPlan, layer_id: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write one cache's new keys and values ([b, kv_heads, q, D]) at their slots, and attend over the cache
        (with the layer's attention sinks [heads] float32 contiguous, `with_sinks`, where it has them)."""
        keys, values = (plan.cache.ring_keys, plan.cache.ring_values) if plan.ring else \
            (plan.cache.keys, plan.cache.values)
        keys, values = keys[layer_id], values[layer_id]
        if plan.window:
            return self._attend_ring_prompt(plan, keys, values, query, key, value, sinks)
        q = key.shape[2]
        if plan.start is not None:
            keys[:, :, plan.start:plan.start + q] = key
            values[:, :, plan.start:plan.start + q] = value
        else:
            # Advanced indices split by a slice put their dims first: the target view is [B, q, kv_heads, D].
            row_ids = torch.arange(key.shape[0], device=self.device)[:, None]
            keys[row_ids, :, plan.slots] = key.transpose(1, 2)
            values[row_ids, :, plan.slots] = value.transpose(1, 2)
        start = plan.start
        if plan.causal_chunk:
            return self._attend_prompt(query, keys, values, start, key, value, sinks)
        if plan.causal_rows:  # a prompt chunk, then a draft tree that sees all of it
            n = plan.causal_rows
            chunk = self._attend_prompt(query[:, :, :n], keys, values, start, key[:, :, :n], value[:, :, :n], sinks)
            return torch.cat([chunk, self._attend_masked(plan, keys, values, query[:, :, n:], sinks)], dim=2)
        return self._attend_masked(plan, keys, values, query, sinks)

    def _attend_prompt(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                       key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A prompt chunk's attention (query [b, heads, q, D] at positions start..): the cache's first `start` keys
        and causally its own (key, value), already written to the cache after them."""
        if self.kernel:
            return _prompt_kernel(query, keys, values, start, self.num_kv_heads, sinks)
        return _prefix_then_causal(query, keys[:, :, :start], values[:, :, :start], key, value, sinks)

    def _attend_ring_prompt(self, plan: AttentionPlan, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """A prompt chunk in a sliding-window layer by the prompt kernel: its keys and values to their ring slots,
        then attention over the window before it and the chunk, in position order (a view of the ring where they do
        not wrap around its end, else gathered)."""
        slots = plan.slots[0]
        keys.index_copy_(2, slots, key)
        values.index_copy_(2, slots, value)
        size, q = keys.shape[2], key.shape[2]
        before = min(plan.start, plan.window - 1)
        first = (plan.start - before) % size
        if first + before + q <= size:
            keys, values = keys[:, :, first:first + before + q], values[:, :, first:first + before + q]
        else:
            order = (first + torch.arange(before + q, device=self.device)) % size
            keys, values = keys.index_select(2, order), values.index_select(2, order)
        return _prompt_kernel(query, keys, values, before, self.num_kv_heads, sinks, plan.window)

    def _attend_masked(self, plan: AttentionPlan, keys: torch.Tensor, values: torch.Tensor,
                       query: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `query` [b, heads, q, D] over the cache's first kv_len slots, by plan.mask or the kernel."""
        # The query heads that share a KV head attend as the rows of one head, so each KV head is read once per step
        # rather than once per query head: a step's attention is bound by reading the cache, not by its arithmetic.
        bsz, _, q, head_dim = query.shape
        folded = query.reshape(bsz, self.num_kv_heads, self.num_heads // self.num_kv_heads * q, head_dim)
        if plan.kernel is not None:
            prefix, see, scores = plan.kernel
            folded, out = folded.contiguous(), torch.empty_like(folded)
            _kernels.decode_attention(
                folded.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), scores.data_ptr(),
                scores.shape[1], bsz, self.num_kv_heads, folded.shape[2], head_dim, q, prefix.data_ptr(),
                see.data_ptr(), _address(sinks), keys.stride(0), keys.stride(1), keys.stride(2), head_dim ** -0.5,
                scores.shape[0])
            return out.view(bsz, self.num_heads, q, head_dim)
        keys, values = keys[:, :, :plan.kv_len], values[:, :, :plan.kv_len]
        if sinks is None:
            out = FLASH_CPU(folded, keys, values, attn_mask=plan.mask)[0] if self.cpu_flash else \
                F.scaled_dot_product_attention(folded, keys, values, attn_mask=plan.mask)
            return out.view(bsz, self.num_heads, q, head_dim)
        if self.cpu_flash:
            out, lse = FLASH_CPU(folded, keys, values, attn_mask=plan.mask)[:2]
        else:  # PyTorch's attention gives no log-sum-exp here: by hand
            scores = (folded @ keys.transpose(-1, -2)).float() * head_dim ** -0.5
            if plan.mask is not None:
                scores = scores.masked_fill(~plan.mask, float("-inf"))
            lse, out = torch.logsumexp(scores, -1), torch.softmax(scores, -1).to(values.dtype) @ values
        group = self.num_heads // self.num_kv_heads  # folded row g * q + i is query head kv_head * group + g
        folded_sinks = sinks.view(self.num_kv_heads, group, 1).expand(-1, -1, q).reshape(self.num_kv_heads, -1)
        return with_sinks(out, lse, folded_sinks).to(query.dtype).view(bsz, self.num_heads, q, head_dim)
