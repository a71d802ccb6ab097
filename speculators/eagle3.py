"""EAGLE-3: the autoregressive baseline. One decoder layer (2H attention input), K sequential passes: pass j feeds draft
token j and the drafter's own pre-norm output of pass j-1 (not fc'd) back in at position p+j. The draft slots' keys
and values live in a scratch cache that is dropped after proposing; accepted tokens are re-run with target features.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hybridspec.proposal import Proposal
from hybridspec.speculators.chains import ChainLayout
from hybridspec.speculators.drafter import ProbsFn, chain_proposal
from hybridspec.speculators.eagle import EagleBase, EagleState


class Eagle3Drafter(EagleBase):
    name = "eagle3"

    @torch.inference_mode()
    def propose(self, state: EagleState, num_speculative_tokens: int, probs_fn: ProbsFn | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        self.run_pending(state)
        scratch = state.kv.fork()
        logits, hidden = state.last_logits, state.last_hidden
        tokens, probs, full = [], [], []
        for j in range(num_speculative_tokens):
            (token,), (prob,), full_row = self.draft(logits[None], probs_fn, generator)
            tokens.append(token)
            probs.append(prob)
            full.append(full_row)
            if j + 1 == num_speculative_tokens:
                break
            position = torch.tensor([state.num_slots + j])
            hidden = self.forward_slots(scratch, hidden[None], torch.tensor([token]), position, keep=1)[0]
            logits = self.lm_head(self.norm(hidden))
        return chain_proposal(tokens, probs, torch.cat(full), self.name)

    def chain_logits(self, aux: Tensor, next_tokens: Tensor, layout: ChainLayout) -> list[Tensor]:
        """Training-time test: depth d runs after depth d-1, fed its pre-norm output and the real next token."""
        num_layers, depths = len(self.layers), len(layout.origins)
        keys: list[list[Tensor]] = [[] for _ in range(num_layers)]
        values: list[list[Tensor]] = [[] for _ in range(num_layers)]
        masks = [layout.prefix_mask(d) for d in range(depths)]
        hidden, logits = self.fc(aux), []
        for d in range(depths):
            origins = layout.origins[d]
            if d > 0:  # the previous depth's output of the same chain
                hidden = hidden[layout.rank_in_depth[d - 1][origins]]
            h, emb = [hidden], [self.embed_tokens(next_tokens[origins + d])]
            for i in range(num_layers):
                h = self.layer_chain_step(i, h, emb, layout, range(d, d + 1), keys[i], values[i], masks)
            hidden = h[0]
            logits.append(self.lm_head(self.norm(hidden)))
        return logits
