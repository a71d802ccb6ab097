"""P-EAGLE: an EAGLE-3-style drafter that produces all K draft tokens in one forward pass.

The real slots (fc of the target's aux hidden states + the token that followed) are followed by K-1 parallel slots
whose token is `mask_token_id` and whose hidden state is fc(mask_hidden), at positions p+1..p+K-1; slot j's output
is draft token j+1. Only the real slots' keys and values stay in the drafter's KV cache.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from hybridspec.proposal import Proposal
from hybridspec.speculators.chains import ChainLayout
from hybridspec.speculators.drafter import ProbsFn, chain_proposal
from hybridspec.speculators.eagle import EagleBase, EagleConfig, EagleState


class PEagleDrafter(EagleBase):
    name = "peagle"

    def __init__(self, config: EagleConfig, embed_tokens: Tensor | None = None) -> None:
        if config.mask_token_id is None or not 0 <= config.mask_token_id < config.target_vocab_size:
            raise ValueError(f"P-EAGLE needs a mask_token_id inside the target vocabulary, got {config.mask_token_id}")
        super().__init__(config, embed_tokens)
        # [1, kH] like vLLM's buffer; initialised like a typical target hidden state so fc sees a sane input.
        self.mask_hidden = nn.Parameter(torch.randn(1, len(config.aux_layer_ids) * config.target_hidden_size) * 0.02)

    def _mask_slots(self, n: int) -> tuple[Tensor, Tensor]:
        hidden = self.fc(self.mask_hidden).expand(n, -1)
        tokens = torch.full((n,), self.config.mask_token_id, dtype=torch.long, device=hidden.device)
        return hidden, tokens

    @torch.inference_mode()
    def propose(self, state: EagleState, num_speculative_tokens: int, probs_fn: ProbsFn | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """K draft tokens from ONE forward pass over the pending real slots and K-1 mask slots."""
        return self.propose_many([state], [num_speculative_tokens], probs_fn, generator)[0]

    @torch.inference_mode()
    def propose_many(self, states: Sequence[EagleState], num_speculative_tokens: Sequence[int],
                     probs_fn: ProbsFn | None = None, generator: torch.Generator | None = None) -> list[Proposal]:
        """Every state's K draft tokens from one forward pass over all their pending real slots and mask slots."""
        outs = self.run_pending_many(states, [self._mask_slots(k - 1) if k > 1 else (None, None)
                                              for k in num_speculative_tokens])
        proposals = []
        for state, k, out in zip(states, num_speculative_tokens, outs):
            logits = state.last_logits[None]
            if k > 1:
                logits = torch.cat([logits, self.lm_head(self.norm(out))])
            tokens, probs, full = self.draft(logits, probs_fn, generator)
            proposals.append(chain_proposal(tokens, probs, full, self.name))
        return proposals

    def chain_logits(self, aux: Tensor, next_tokens: Tensor, layout: ChainLayout) -> list[Tensor]:
        depths = range(len(layout.origins))
        mask_h, mask_t = self._mask_slots(1)
        hidden = [self.fc(aux)] + [mask_h.expand(layout.origins[d].numel(), -1) for d in depths[1:]]
        emb0 = self.embed_tokens(next_tokens)
        emb_mask = self.embed_tokens(mask_t)
        emb = [emb0] + [emb_mask.expand(layout.origins[d].numel(), -1) for d in depths[1:]]
        masks = [layout.prefix_mask(d) for d in depths]
        for i in range(len(self.layers)):
            hidden = self.layer_chain_step(i, hidden, emb, layout, depths, [], [], masks)
        sizes = [h.shape[0] for h in hidden]
        return list(self.lm_head(self.norm(torch.cat(hidden))).split(sizes))

