"""The target model: prefill, and verification of a chain or a tree of draft tokens in one forward pass.

`TargetModel` runs the forward pass of a decoder-only causal LM (SUPPORTED_MODEL_TYPES; their layers:
`hybridspec.model.layers`) itself, over the loaded transformers model's weights, with a preallocated KV cache of B rows
(one per sequence in flight; Gated DeltaNet layers keep a state instead, `hybridspec.model.delta_net`):

- A step feeds each row its last committed token followed by its draft nodes ([B, q] tokens, a cache's rows padded to
  the same q; the caches of one pass, concurrent calls and a prompt's chunk beside them, packed without padding).
  Node i of a row sits at position base + depth(i) and attends to the row's committed prefix plus its own ancestors
  (`hybridspec.model.attention`).
- After verification only the accepted path is kept: for a chain the row's length just moves forward (a crop of the
  rejected suffix); for a tree the accepted nodes' keys and values are gathered into consecutive slots (compaction).
- Hidden states that drafters read (inputs of layers 2, L//2 and L-3, and the final normed state) are returned on
  request, and a prompt's last `drafter_context` positions' as `drafter_features` (`hybridspec.model.inputs`).
- A greedy step needs only each row's argmax: its output layer runs on its weight rounded to int8, with the tokens
  that could be the maximum recomputed in float32 (`hybridspec.model.head`).
- A step's products stream a weight of bfloat16 values (a bfloat16 checkpoint loaded into float32) in bfloat16, the
  same bits from half the bytes (`hybridspec.model.linear.compact_weights`).

Why not `model(..., past_key_values=DynamicCache)`: a DynamicCache grows by `torch.cat` of every layer's keys and
values at every step, and `crop` leaves strided views behind; measured here, transformers' own forward spent more time
in those concatenations than in the matrix work. A static cache written in place, fused QKV / gate-up projections
(`Linear`: MKL's product for a few rows, oneDNN's with a prepacked weight for more) and a precomputed rotary table
leave mostly the matrix work, for the baseline and the speculative path alike (both use this class).

Batching uses padding (one cache tensor with B rows, each with its own length, positions and draft) rather than B
separate caches run one after another: a decode step is bound by reading the weights, so B rows in one pass cost
little more than one row, while separate caches read the weights B times (`python benchmarks/bench_verify_cost.py
--batch` measures it).
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import Sequence

import torch

from hybridspec.model.attention import STEP_KERNEL_MAX_QUERIES, Attention, rotary_table
from hybridspec.model.delta_net import new_pending
from hybridspec.model.head import GreedyHead
from hybridspec.model.inputs import ForwardPart, StepInput, StepOutput, step_part
from hybridspec.model.kv_cache import KVCache, RingShape
from hybridspec.model.layers import ACTIVATIONS, DecoderLayer, is_gemma, layer_window, norm_weight, rotary_dim
from hybridspec.model.linear import KERNEL_ROWS, Linear, tune_products
from hybridspec.model.norms import norm_and_rotate, rms_norm
from hybridspec.speculators.features import default_aux_layer_ids

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text", "qwen3_5",
                         "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
# Prefill chunks: long where the chunk attends causally without a mask (fewer passes; PyTorch's flash attention, where
# the prompt kernel does not run, skips more of the blocks above the diagonal in one long chunk than in several short
# ones), short where a mask is needed (its memory).
CAUSAL_CHUNK, MASKED_CHUNK = 2048, 512


class TargetModel:
    """A transformers causal LM of SUPPORTED_MODEL_TYPES run with a static KV cache, tree attention and hidden-state
    capture."""

    def __init__(self, model, max_seq_len: int | None = None, pack_weights: bool = True, tune: bool = True):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported by the engine; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}. Other architectures run in vLLM plugin mode (docs/vllm.md).")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, cap, None):
                raise ValueError(f"{cap} is not supported (Gemma 2's; Gemma 3 has none)")
        self.model, self.config = model, config
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
        self.norm_kernel = KERNEL_ROWS > 0 and self.device.type == "cpu"  # float32 norms by the C kernel
        with torch.no_grad():
            self.embed = decoder.embed_tokens.weight
            # Gemma scales its embeddings by sqrt(hidden size), rounded to the weights' dtype as transformers does
            self.embed_scale = torch.tensor(self.hidden_size ** 0.5).to(self.dtype) if is_gemma(config) else None
            # attention layers keep keys and values (sliding-window layers in a ring of their window), Gated DeltaNet
            # layers a state: each kind indexed on its own
            kinds = ["delta" if hasattr(layer, "linear_attn") else "window" if layer_window(config, i) else "full"
                     for i, layer in enumerate(decoder.layers)]
            self.layers = [DecoderLayer(layer, config, i, pack_weights, self.num_heads, self.num_kv_heads,
                                        self.head_dim, kinds[:i].count(kind)) for i, (layer, kind)
                           in enumerate(zip(decoder.layers, kinds))]
            self.num_kv_layers = kinds.count("full")
            windows = [layer.window for layer in self.layers if layer.window]
            # a ring holds the window and one pass's inputs: a prompt chunk's, a step's and its draft's
            self.ring = RingShape(len(windows), max(windows), MASKED_CHUNK + 1 + STEP_KERNEL_MAX_QUERIES) \
                if windows else None
            deltas = [layer.delta for layer in self.layers if layer.delta is not None]
            self.recurrent = deltas[0].shape(len(deltas), self.dtype) if deltas else None
            self.final_norm = norm_weight(decoder.norm, config)
            self.lm_head = Linear(model.get_output_embeddings().weight, pack=pack_weights)
            head_weight = model.get_output_embeddings().weight
            self.greedy_head = GreedyHead(head_weight) if pack_weights and GreedyHead.runs_here(head_weight) else None
            if pack_weights and tune:  # each product's kernel and rows as this machine runs them fastest
                tune_products(self.linears())
            # [max_seq_len, head_dim / 2] complex: every position's rotation, by the model's own rotary module; Gemma
            # has one per layer type (local layers rotate by another base)
            rotary = rotary_dim(config, self.head_dim)
            self.ropes = {kind: rotary_table(
                decoder.rotary_emb if kind is None else functools.partial(decoder.rotary_emb, layer_type=kind),
                self.embed[:1][None], self.max_seq_len, self.head_dim, rotary)
                for kind in {layer.rope_kind for layer in self.layers if layer.delta is None}}
        self.attention = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.device,
                                   self.max_seq_len)
        # The longest prompt chunk a step with a draft tree runs in one pass: where the chunk attends causally apart
        # (`ForwardPart.causal_rows`) the mask spans the tree alone; elsewhere it spans the chunk too.
        self.tree_prompt_chunk = CAUSAL_CHUNK if self.attention.cpu_flash else MASKED_CHUNK
        # Sliding windows: their layers attend under a mask over their ring (`Attention.plan_ring`), so chunks stay
        # short
        self.windows = sorted({layer.window for layer in self.layers if layer.window})
        if self.windows:
            self.tree_prompt_chunk = MASKED_CHUNK

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "smollm2", dtype: torch.dtype = torch.float32,
                        max_seq_len: int | None = None, pack_weights: bool = True,
                        tune: bool = True) -> "TargetModel":
        from hybridspec.model.loading import load_model

        return cls(load_model(name_or_path, dtype=dtype), max_seq_len=max_seq_len, pack_weights=pack_weights,
                   tune=tune)

    def linears(self) -> list[Linear]:
        """Every product of a forward pass, in the order a pass runs them."""
        products = [lin for layer in self.layers for lin in layer.linears()]
        return products + [self.lm_head]

    @property
    def kv_bytes_per_token(self) -> int:
        """The bytes of one token's keys and values, every attention layer without a sliding window."""
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def state_bytes_per_row(self) -> int:
        """The bytes a sequence holds whatever its length (0: none): its linear-attention state and its
        sliding-window layers' ring."""
        states = 0 if self.recurrent is None else self.recurrent.bytes_per_row
        rings = 0 if self.ring is None else self.ring.bytes_per_row(self.num_kv_heads, self.head_dim, self.dtype)
        return states + rings

    def new_cache(self, batch_size: int = 1, capacity: int = 1024) -> KVCache:
        return KVCache(self.num_kv_layers, batch_size, self.num_kv_heads, self.head_dim,
                       min(capacity, self.max_seq_len), self.dtype, self.device, self.recurrent, self.ring)

    # ------------------------------------------------------------------------------------------------------------
    # forward

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.norm_kernel)

    def _norm_and_rotate(self, query_key: torch.Tensor, layer: DecoderLayer, rope: torch.Tensor) -> torch.Tensor:
        return norm_and_rotate(query_key, layer.q_norm, layer.k_norm, layer.qk_norm, rope, self.num_heads, self.eps,
                               self.norm_kernel)

    @torch.inference_mode()
    def forward(self, parts: Sequence[ForwardPart], *, return_hidden: bool = False,
                hidden_at_every_input: bool = False, argmax_only: bool = False) -> list[StepOutput]:
        """Run every part's inputs in one pass (`ForwardPart`); does not change the rows' lengths. One output per part:
        [b, n, ...] at its output_index (n = q without one).

        Concurrent calls share the pass: the linear layers, where a decode step spends its time reading weights, run
        once for all of them. hidden_at_every_input keeps the hidden states at every input all the same (what a drafter
        reads of a prompt). argmax_only: the logits need to be right only where they are their row's maximum (greedy
        verification), which a small pass gets sooner (`GreedyHead`); the maximum over a part's token_masks where it
        has them (its other logits then -inf).
        """
        plans, positions, spans, begin = [], [], [], 0
        for part in parts:
            b, q = part.tokens.shape
            if part.cache.batch_size != b:
                raise ValueError(f"{b} input rows for a cache of {part.cache.batch_size} rows")
            plans.append(self.attention.plan(part.cache, part.depths, part.tree_mask, part.causal, part.causal_rows))
            lengths = torch.tensor(part.cache.lengths, dtype=torch.long, device=self.device)
            positions.append((lengths[:, None] + part.depths).reshape(-1))
            spans.append((begin, begin + b * q))
            begin += b * q
            if part.cache.recurrent is not None:  # room for what the step's nodes compute, until commit
                nodes = 0 if part.node_parents is None else part.node_parents.shape[1]
                part.cache.pending = new_pending(part.cache.recurrent, b, nodes, self.device) if nodes else None
        total = begin
        positions = torch.cat(positions)
        ropes = {kind: table[positions][:, None] for kind, table in self.ropes.items()}  # [T, 1, D / 2] each
        joined = self.attention.join_steps(plans, spans) if len(parts) > 1 else []
        apart = sorted(set(range(len(parts))) - {i for j in joined for i in j.parts})

        hq, hk, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # sliding-window layers attend over their ring, by a plan per window
        ring_plans = {w: [self.attention.plan_ring(part.cache, part.depths, part.tree_mask, w, part.causal)
                          for part in parts] for w in self.windows}
        x = self.embed[torch.cat([p.tokens.reshape(-1) for p in parts])]  # [T, H], every part's inputs packed
        if self.embed_scale is not None:
            x = x * self.embed_scale
        layer_inputs = {}
        for layer_id, layer in enumerate(self.layers):
            if return_hidden and layer_id in self.aux_layer_ids:
                layer_inputs[layer_id] = x
            if layer.delta is not None:
                x = layer.delta.plus(self._rms_norm(x, layer.input_norm), parts, spans, x)
                x = layer.mlp.plus(self._rms_norm(x, layer.post_norm), x)
                continue
            qkv = layer.qkv(self._rms_norm(x, layer.input_norm))
            query_key = qkv[:, :(hq + hk) * hd].view(total, hq + hk, hd)
            query_key = self._norm_and_rotate(query_key, layer, ropes[layer.rope_kind])
            if layer.window:
                attn = self._attend(layer, ring_plans[layer.window], [], range(len(parts)), parts, spans, query_key,
                                    qkv)
            else:
                attn = self._attend(layer, plans, joined, apart, parts, spans, query_key, qkv)
            if layer.gated:  # Qwen3.5: each head's output scaled by sigmoid of its gate
                attn = attn * torch.sigmoid(qkv[:, (hq + 2 * hk) * hd:])
            if layer.attn_out_norm is None:
                x = layer.o.plus(attn, x)
                x = layer.mlp.plus(self._rms_norm(x, layer.post_norm), x)
            else:  # Gemma: norms on the attention's and the MLP's outputs
                x = x + self._rms_norm(layer.o(attn), layer.attn_out_norm)
                x = x + self._rms_norm(layer.mlp(self._rms_norm(x, layer.post_norm)), layer.mlp_out_norm)

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
        greedy = argmax_only and self.greedy_head is not None and final_out.shape[0] <= GreedyHead.MAX_ROWS
        if final_out.shape[0] and greedy:
            masks = None
            if any(p.token_masks is not None for p in parts):
                words = next(p.token_masks for p in parts if p.token_masks is not None).shape[-1]
                masks = torch.cat([p.token_masks.reshape(-1, words) if p.token_masks is not None else
                                   torch.full((b * n, words), -1, dtype=torch.int32, device=self.device)
                                   for p, (b, n) in zip(parts, shapes)])
            logits = self.greedy_head(final_out, masks)
        elif final_out.shape[0]:
            logits = self.lm_head(final_out)
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
            if part.features_index is not None:
                rows = lo + part.features_index
                aux_at = torch.cat([layer_inputs[i][rows] for i in self.aux_layer_ids], dim=-1)
                out.drafter_features = [(aux_at, self._rms_norm(x[rows], self.final_norm))]
        return outs

    def _attend(self, layer: DecoderLayer, plans: Sequence, joined: Sequence, apart: Sequence[int],
                parts: Sequence[ForwardPart], spans: Sequence[tuple[int, int]], query_key: torch.Tensor,
                qkv: torch.Tensor) -> torch.Tensor:
        """One layer's attention for every part of the pass: [T, heads * D] in the packed inputs' order."""
        hq, hk, hd = self.num_heads, self.num_kv_heads, self.head_dim
        attn = []
        for i in apart:
            (lo, hi), (b, q) = spans[i], parts[i].tokens.shape
            qk = query_key[lo:hi].view(b, q, hq + hk, hd)
            value = qkv[lo:hi, (hq + hk) * hd:(hq + 2 * hk) * hd].view(b, q, hk, hd).transpose(1, 2)
            query, key = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
            out = self.attention.attend(plans[i], layer.kv_index, query, key, value, layer.sinks)
            attn.append(out.transpose(1, 2).reshape(b * q, hq * hd))
        if not joined:
            return attn[0] if len(attn) == 1 else torch.cat(attn)
        # the steps of many caches: one kernel call each (`Attention.join_steps`), in their places
        everything = query_key.new_empty(query_key.shape[0], hq * hd)
        for j in joined:
            everything[j.inputs] = self.attention.attend_joined(j, layer.kv_index, query_key[j.inputs],
                                                                qkv[j.inputs, (hq + hk) * hd:(hq + 2 * hk) * hd],
                                                                layer.sinks)
        for i, out in zip(apart, attn):
            everything[spans[i][0]:spans[i][1]] = out
        return everything

    # ------------------------------------------------------------------------------------------------------------
    # prefill and verification steps

    def prefill(self, cache: KVCache, tokens: Sequence[Sequence[int]], *, chunk_size: int | None = None,
                return_hidden: bool = False, drafter_context: int = 0, logits_tail: int = 1,
                argmax_only: bool = False) -> StepOutput:
        """Append tokens[b] to row b of the cache, for all rows in one batched pass per chunk; a row may get none.

        Returns the output at each row's last new token ([B, 1, ...]; meaningless for rows that got none; one row
        only: logits_tail=n gives the logits at its last n tokens, [1, n, V]), and with drafter_context=n, as
        drafter_features, the target features (aux and final hidden states) at each row's last min(n, len(tokens[b]))
        new tokens, which a drafter reads. Rows are padded to the longest; chunks (of chunk_size tokens; default
        CAUSAL_CHUNK where every row has the same length and gets as many tokens on a CPU, else MASKED_CHUNK) bound the
        attention mask's memory. argmax_only: as in `forward`.
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
        if logits_tail != 1 and (len(tokens) != 1 or not 1 <= logits_tail <= counts[0] or drafter_context
                                 or return_hidden):
            raise ValueError("logits_tail needs one row of at least that many tokens, and no hidden states")
        cache.reserve(longest)
        if chunk_size is None:
            uniform = len(set(counts)) == 1 and len(set(cache.lengths)) == 1
            # a sliding-window layer's ring holds a window and MASKED_CHUNK inputs
            chunk_size = CAUSAL_CHUNK if uniform and not self.windows and self.attention.cpu_flash else MASKED_CHUNK
        bsz, out = cache.batch_size, None
        last = torch.zeros(bsz, dtype=torch.long)
        features: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(bsz)]
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
                # a row that ended in an earlier chunk: any index inside this chunk (its output is not kept)
                last[b] = len(chunk) - 1 if chunk else 0
            part = ForwardPart(cache, ids.to(self.device), torch.arange(q, device=self.device).expand(bsz, q),
                               mask.to(self.device), causal=all(len(c) == q for c in chunks),
                               output_index=(last[:, None] + torch.arange(1 - logits_tail, 1)).to(self.device),
                               prompt_lengths=[len(c) for c in chunks])
            step = self.forward([part], return_hidden=return_hidden or drafter_context > 0,
                                hidden_at_every_input=drafter_context > 0, argmax_only=argmax_only)[0]
            if drafter_context > 0:
                for b, chunk in enumerate(chunks):
                    skip = max(0, counts[b] - drafter_context - begin)  # row b's inputs begin.. in this chunk
                    if skip < len(chunk):
                        features[b].append((step.aux_hidden[b, skip:len(chunk)],
                                            step.final_hidden[b, skip:len(chunk)]))
                rows = torch.arange(bsz, device=self.device)
                step = StepOutput(step.logits, step.aux_hidden[rows, last][:, None],
                                  step.final_hidden[rows, last][:, None])
            ends_here = [bool(c) and begin + len(c) == n for c, n in zip(chunks, counts)]
            out = step if out is None else out.with_rows(step, torch.tensor(ends_here, device=self.device))
            for b, chunk in enumerate(chunks):
                cache.lengths[b] += len(chunk)
        if drafter_context > 0:
            width_aux, width = out.aux_hidden.shape[-1], out.final_hidden.shape[-1]
            out.drafter_features = [
                (torch.cat([a for a, _ in row]) if row else out.aux_hidden.new_zeros(0, width_aux),
                 torch.cat([f for _, f in row]) if row else out.final_hidden.new_zeros(0, width)) for row in features]
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
        parts = [step_part(i, self.vocab_size, self.device) for i in inputs]
        outs = self.forward(parts, return_hidden=return_hidden, argmax_only=argmax_only)
        for i in inputs:
            i.cache.lengths[0] += len(i.prompt)
        return outs
