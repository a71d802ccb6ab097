"""The EAGLE family's shared model: EAGLE-3 and P-EAGLE share everything but how the K drafts are produced."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from hybridspec.speculators.chains import ChainLayout, chain_attention
from hybridspec.speculators.drafter import Drafter, ProbsFn, as_token_tensor, draft_token
from hybridspec.speculators.features import TargetFeatures, TargetInfo, check_target
from hybridspec.speculators.layers import DecoderLayer, DraftKVCache, LayerConfig, RMSNorm, Rotary, attend, causal_mask


@dataclass
class EagleConfig:
    """Architecture of an EAGLE-3 / P-EAGLE drafter and the target facts it was built for."""

    layer: LayerConfig
    num_layers: int
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False
    mask_token_id: int | None = None  # P-EAGLE: the token id of the K-1 parallel slots
    independent_layers: bool = False  # FastEagle's no-cascade ablation: every layer reads the fused features
    num_speculative_tokens: int = 3   # the default K recorded in the checkpoint

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.target_vocab_size}, got {self.draft_vocab_size}")


@dataclass
class SlotRun:
    """One sequence's part of a drafter pass (`EagleBase.forward_slots_many`): n new slots (hidden [n, H] in drafter
    space, tokens [n], positions [n]) attending over `kv`, whose first `keep` are appended to it."""

    kv: DraftKVCache
    hidden: Tensor
    tokens: Tensor
    positions: Tensor
    keep: int


@dataclass
class EagleState:
    """One sequence's drafting state: KV of the real slots already run, the real slots waiting for the next pass, and
    the outputs of the last real slot (so `propose` can be called again without new tokens)."""

    kv: DraftKVCache = field(default_factory=DraftKVCache)
    num_slots: int = 0                      # real slots run or pending; the next real slot's position
    pending_aux: list[Tensor] = field(default_factory=list)
    pending_tokens: list[Tensor] = field(default_factory=list)
    last_logits: Tensor | None = None       # [draft_vocab] of the last real slot
    last_hidden: Tensor | None = None       # [H] pre-norm output of the last real slot (EAGLE-3 feeds it back;
                                            # FastEagle: [L, H], every layer's)


class EagleBase(Drafter):
    """fc over the concatenated aux hidden states, decoder layers (the first with 2H attention input), final norm and a
    reduced-vocabulary lm_head. The input embedding is the target's (shared, frozen), passed in by the caller."""

    def __init__(self, config: EagleConfig, embed_tokens: Tensor | None = None) -> None:
        super().__init__()
        cfg, hidden = config, config.layer.hidden_size
        self.config = cfg
        self.aux_layer_ids = cfg.aux_layer_ids
        if embed_tokens is None:
            self.embed_tokens = nn.Embedding(cfg.target_vocab_size, hidden)
        else:
            if tuple(embed_tokens.shape) != (cfg.target_vocab_size, hidden):
                raise ValueError(f"target embedding {tuple(embed_tokens.shape)} does not fit the drafter "
                                 f"({cfg.target_vocab_size}, {hidden})")
            self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.detach(), freeze=True)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, hidden, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer, first=i == 0 or cfg.independent_layers,
                                                 norm_before_residual=cfg.norm_before_residual)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(hidden, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg.layer.head_dim, cfg.layer.rope_theta)
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)  # identity on the first draft_vocab_size ids
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    # -- vocabulary -------------------------------------------------------------------------------------------------

    def set_draft_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocabulary maps {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self) -> Tensor:
        """[draft_vocab] target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def full_vocab_logits(self, logits: Tensor) -> Tensor:
        """[..., draft_vocab] -> [..., target_vocab], -inf for tokens the drafter cannot propose."""
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
        full[..., self.draft_to_target()] = logits
        return full

    def check_target(self, target: Any, aux_layer_ids: Sequence[int] | None = None) -> None:
        check_target(self.name, target=TargetInfo.of(target), hidden_size=self.config.target_hidden_size,
                     vocab_size=self.config.target_vocab_size, aux_layer_ids=self.aux_layer_ids,
                     expected_aux_layer_ids=aux_layer_ids)

    # -- inference ---------------------------------------------------------------------------------------------------

    def new_state(self) -> EagleState:
        return EagleState()

    def accept(self, state: EagleState, features: TargetFeatures, tokens: Tensor | Sequence[int]) -> None:
        tokens = as_token_tensor(tokens, len(features))
        if features.aux.shape[-1] != self.fc.in_features:
            raise ValueError(f"aux features have width {features.aux.shape[-1]}, the drafter expects "
                             f"{self.fc.in_features} ({len(self.aux_layer_ids)} layers x target hidden size)")
        state.pending_aux.append(features.aux)
        state.pending_tokens.append(tokens)
        state.num_slots += len(tokens)

    def forward_slots(self, kv: DraftKVCache, hidden: Tensor, tokens: Tensor, positions: Tensor, keep: int,
                      every_layer: bool = False) -> Tensor | list[Tensor]:
        """Run the layers over n new slots (hidden [n, H] already in drafter space, tokens [n]), attending to the slots
        in `kv` and causally to each other; the first `keep` new slots' keys and values are appended to `kv`.
        Returns the pre-norm outputs [n, H] (of every layer, a list, with every_layer)."""
        return self.forward_slots_many([SlotRun(kv, hidden, tokens, positions, keep)], every_layer)[0]

    def forward_slots_many(self, runs: Sequence["SlotRun"], every_layer: bool = False) -> list:
        """`forward_slots` for several sequences' slots in one pass: the linear layers over all of them at once (a
        drafter's weights read once, not once per sequence), attention per sequence over its own cache."""
        param = self.lm_head.weight
        sizes = [r.tokens.numel() for r in runs]
        fused = torch.cat([r.hidden for r in runs]).to(param.dtype)
        emb = self.embed_tokens(torch.cat([r.tokens for r in runs]).to(param.device)).to(param.dtype)
        cos, sin = self.rotary(torch.cat([r.positions for r in runs]).to(param.device))
        masks = [causal_mask(n, len(r.kv), device=fused.device) for r, n in zip(runs, sizes)]
        h, outs = fused, []
        for i, layer in enumerate(self.layers):
            x, residual = layer.attn_input(fused if layer.first else h, emb if layer.first else None)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            attn = []
            for r, qs, ks, vs, mask in zip(runs, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), masks):
                ks, vs = r.kv.extend(i, ks, vs)
                attn.append(attend(qs, ks, vs, mask))
            h = layer.finish(layer.self_attn.out(attn[0] if len(attn) == 1 else torch.cat(attn, dim=1)), residual)
            outs.append(h)
        for r in runs:
            r.kv.commit(r.keep)
        if every_layer:
            return [list(per_run) for per_run in zip(*(o.split(sizes) for o in outs))]
        return list(h.split(sizes))

    def run_pending(self, state: EagleState, extra_hidden: Tensor | None = None, extra_tokens: Tensor | None = None
                    ) -> Tensor | None:
        """Run the pending real slots (committing their KV) together with optional extra slots that follow them
        (not committed) in one forward pass; returns the pre-norm outputs of the extra slots."""
        return self.run_pending_many([state], [(extra_hidden, extra_tokens)])[0]

    def run_pending_many(self, states: Sequence[EagleState],
                         extras: Sequence[tuple[Tensor | None, Tensor | None]]) -> list[Tensor | None]:
        """`run_pending` for several states in one pass (`forward_slots_many`)."""
        runs, real = [], []
        for state, (extra_hidden, extra_tokens) in zip(states, extras):
            if not state.pending_tokens:
                if state.last_logits is None:
                    raise RuntimeError("propose() before any features were given: call begin() first")
                real.append(0)
                runs.append(None if extra_hidden is None else SlotRun(
                    state.kv.fork(), extra_hidden, extra_tokens, torch.arange(extra_tokens.numel()) + state.num_slots,
                    keep=0))
                continue
            hidden, tokens, positions = self.take_pending(state)
            real.append(tokens.numel())
            if extra_hidden is not None:
                hidden, tokens = torch.cat([hidden, extra_hidden]), torch.cat([tokens, extra_tokens])
                positions = torch.arange(tokens.numel()) + positions[0]
            runs.append(SlotRun(state.kv, hidden, tokens, positions, keep=real[-1]))
        outs = iter(self.forward_slots_many([r for r in runs if r is not None])) if any(runs) else iter(())
        results: list[Tensor | None] = []
        caught_up = []
        for state, run, n_real, (extra_hidden, _) in zip(states, runs, real, extras):
            out = next(outs) if run is not None else None
            if n_real:
                state.last_hidden = out[n_real - 1]
                caught_up.append(state)
            results.append(out[n_real:] if extra_hidden is not None else None)
        if caught_up:  # the last real slots' logits, one product for all
            logits = self.lm_head(self.norm(torch.stack([s.last_hidden for s in caught_up])))
            for state, row in zip(caught_up, logits):
                state.last_logits = row
        return results

    def take_pending(self, state: EagleState) -> tuple[Tensor, Tensor, Tensor]:
        """The pending real slots, none left pending: fc of their aux features, their tokens and their positions."""
        param = self.fc.weight
        aux = torch.cat(state.pending_aux).to(param.device, param.dtype)
        tokens = torch.cat(state.pending_tokens)
        state.pending_aux.clear()
        state.pending_tokens.clear()
        return self.fc(aux), tokens, torch.arange(tokens.numel()) + state.num_slots - tokens.numel()

    def draft(self, logits: Tensor, probs_fn: ProbsFn | None, generator: torch.Generator | None
              ) -> tuple[list[int], list[float], Tensor]:
        """Target token ids, their draft probabilities and the full-vocabulary logits [n, V] of n draft positions,
        from their draft-vocabulary logits [n, draft_vocab]."""
        logits = logits.float()
        full = self.full_vocab_logits(logits)
        if probs_fn is None:  # greedy: all rows at once, softmax over the draft vocabulary only (same values)
            probs = torch.softmax(logits, dim=-1)
            ids = probs.argmax(-1)
            return self.draft_to_target()[ids].tolist(), probs.gather(-1, ids[:, None]).flatten().tolist(), full
        drawn = [draft_token(row, probs_fn, generator) for row in full]
        return [t for t, _ in drawn], [p for _, p in drawn], full

    # -- training ----------------------------------------------------------------------------------------------------

    def chain_logits(self, aux: Tensor, next_tokens: Tensor, layout: ChainLayout) -> list[Tensor]:
        """Draft-vocabulary logits of every element of `layout` ([n_d, draft_vocab] per depth d): the same computation
        as inference, all chains at once. aux [N, kH] and next_tokens [N] are per real slot."""
        raise NotImplementedError

    def layer_chain_step(self, layer_index: int, hidden: list[Tensor], emb: list[Tensor | None], layout: ChainLayout,
                         depths: range, keys: list[Tensor], values: list[Tensor], masks: list[Tensor]) -> list[Tensor]:
        """One decoder layer over the elements of `depths` (hidden[j]/emb[j] for depths[j]), attending to the keys of
        all earlier depths (in keys/values, which this extends). Linear layers run on all depths at once."""
        layer = self.layers[layer_index]
        attn = layer.self_attn
        sizes = [h.shape[0] for h in hidden]
        x, residual = layer.attn_input(torch.cat(hidden), torch.cat(emb) if layer.first else None)
        cos, sin = self.rotary(torch.cat([layout.element_positions(d) for d in depths]))
        q, k, v = attn.qkv(x, cos, sin)
        qs, ks, vs = q.split(sizes, dim=1), k.split(sizes, dim=1), v.split(sizes, dim=1)
        keys.extend(ks)
        values.extend(vs)
        outs = [chain_attention(attn, qs[j], layout, d, keys, values, masks[d]) for j, d in enumerate(depths)]
        h = layer.finish(attn.out(torch.cat(outs, dim=1)), residual)
        return list(h.split(sizes))
