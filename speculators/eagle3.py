"""EAGLE-3: the autoregressive baseline. One decoder layer (2H attention input), K sequential passes: pass j feeds draft
token j and the drafter's own pre-norm output of pass j-1 (not fc'd) back in at position p+j. The draft slots' keys
and values live in a scratch cache that is dropped after proposing; accepted tokens are re-run with target features.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from hybridspec.proposal import Proposal
from hybridspec.speculators.chains import ChainLayout
from hybridspec.speculators.drafter import ProbsFn, chain_proposal
from hybridspec.speculators.eagle import EagleBase, EagleState, SlotRun
from hybridspec.speculators.layers import DraftKVCache


class Eagle3Drafter(EagleBase):
    name = "eagle3"

    @torch.inference_mode()
    def propose(self, state: EagleState, num_speculative_tokens: int, probs_fn: ProbsFn | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        return self.propose_many([state], [num_speculative_tokens], probs_fn, generator)[0]

    @torch.inference_mode()
    def propose_many(self, states: Sequence[EagleState], num_speculative_tokens: Sequence[int],
                     probs_fn: ProbsFn | None = None, generator: torch.Generator | None = None) -> list[Proposal]:
        """Every state's catch-up in one pass, then pass j runs draft token j of every state still drafting, each
        on a scratch fork of its cache."""
        self.run_pending_many(states, [(None, None)] * len(states))
        drafts = [_Draft(s.kv.fork(), s.last_logits, s.last_hidden, s.num_slots, k)
                  for s, k in zip(states, num_speculative_tokens)]
        for j in range(max(num_speculative_tokens, default=0)):
            going = []
            for d in drafts:
                if j < d.k:
                    (token,), (prob,), full_row = self.draft(d.logits[None], probs_fn, generator)
                    d.tokens.append(token)
                    d.probs.append(prob)
                    d.full.append(full_row)
                    if j + 1 < d.k:
                        going.append(d)
            if going:
                runs = [SlotRun(d.scratch, d.hidden[None], torch.tensor([d.tokens[-1]]),
                                torch.tensor([d.num_slots + j]), keep=1) for d in going]
                hidden = torch.cat(self.forward_slots_many(runs))
                for d, h, logits in zip(going, hidden, self.lm_head(self.norm(hidden))):
                    d.hidden, d.logits = h, logits
        return [chain_proposal(d.tokens, d.probs, torch.cat(d.full), self.name) if d.tokens
                else Proposal.empty(self.name) for d in drafts]

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


@dataclass
class _Draft:
    """One state's EAGLE-3 draft in the making: its scratch cache, the last pass's logits and pre-norm output."""

    scratch: DraftKVCache
    logits: Tensor
    hidden: Tensor
    num_slots: int
    k: int
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    full: list[Tensor] = field(default_factory=list)
