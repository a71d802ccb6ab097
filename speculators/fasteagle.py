"""FastEagle: a cascade of L small decoder layers, one per draft position, run once per step.

Layer 0 reads fc(the target's aux features) with the embedding of the token that followed (EAGLE-3's 2H input); layer
i reads layer i-1's output at the same slot. Layer i's output at the last real slot, through the shared norm and
lm_head, is the distribution of draft token i+1, so one pass over the real slots (its lazy catch-up) drafts all L
tokens; every layer keeps the keys and values of the real slots only. Trained end to end without teacher forcing:
layer i's loss is on position i+1 of the same pass (`speculators.train`; optionally with each layer's normed output
aligned to the target's final hidden state there).

`independent_layers=True` (EagleConfig) is the paper's "without the cascade" ablation: every layer reads the fused
features and the embedding (independent parallel heads).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from hybridspec.proposal import Proposal
from hybridspec.speculators.chains import ChainLayout
from hybridspec.speculators.drafter import ProbsFn, chain_proposal
from hybridspec.speculators.eagle import EagleBase, EagleState, SlotRun


class FastEagleDrafter(EagleBase):
    name = "fasteagle"

    @property
    def max_draft_tokens(self) -> int:
        """One draft token per layer."""
        return len(self.layers)

    def run_pending(self, state: EagleState, extra_hidden: Tensor | None = None, extra_tokens: Tensor | None = None
                    ) -> None:
        """Run the pending real slots through the cascade; state.last_hidden becomes [L, H], each layer's pre-norm
        output at the last real slot."""
        self.run_pending_many([state], [(extra_hidden, extra_tokens)])

    def run_pending_many(self, states: Sequence[EagleState], extras: Sequence[tuple[Tensor | None, Tensor | None]]
                         ) -> list[None]:
        """`run_pending` for several states in one pass of the cascade."""
        if any(extra_hidden is not None for extra_hidden, _ in extras):
            raise ValueError("FastEagle drafts from the real slots alone")
        pending = []
        for state in states:
            if state.pending_tokens:
                pending.append(state)
            elif state.last_hidden is None:
                raise RuntimeError("propose() before any features were given: call begin() first")
        runs = []
        for state in pending:
            hidden, tokens, positions = self.take_pending(state)
            runs.append(SlotRun(state.kv, hidden, tokens, positions, keep=tokens.numel()))
        if runs:
            for state, outs in zip(pending, self.forward_slots_many(runs, every_layer=True)):
                state.last_hidden = torch.stack([out[-1] for out in outs])
        return [None] * len(states)

    @torch.inference_mode()
    def propose(self, state: EagleState, num_speculative_tokens: int, probs_fn: ProbsFn | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """min(num_speculative_tokens, L) draft tokens from one pass: draft j is layer j's output."""
        return self.propose_many([state], [num_speculative_tokens], probs_fn, generator)[0]

    @torch.inference_mode()
    def propose_many(self, states: Sequence[EagleState], num_speculative_tokens: Sequence[int],
                     probs_fn: ProbsFn | None = None, generator: torch.Generator | None = None) -> list[Proposal]:
        """Every state's draft from one pass of the cascade over all their pending real slots."""
        self.run_pending_many(states, [(None, None)] * len(states))
        proposals = []
        for state, k in zip(states, num_speculative_tokens):
            k = min(k, self.max_draft_tokens)
            if k <= 0:
                proposals.append(Proposal.empty(self.name))
                continue
            tokens, probs, full = self.draft(self.lm_head(self.norm(state.last_hidden[:k])), probs_fn, generator)
            proposals.append(chain_proposal(tokens, probs, full, self.name))
        return proposals

    def chain_hidden(self, aux: Tensor, next_tokens: Tensor, layout: ChainLayout) -> list[Tensor]:
        """Pre-norm outputs of every element of `layout`: depth d is layer d's output at the origins of depth d (all
        layers run over every real slot, as at inference). layout.origins[0] must be every real slot."""
        emb = self.embed_tokens(next_tokens)
        mask = layout.prefix_mask(0)
        fused = hidden = self.fc(aux)
        outs = []
        for i in range(min(len(self.layers), len(layout.origins))):
            layer_input = fused if self.layers[i].first else hidden
            hidden = self.layer_chain_step(i, [layer_input], [emb], layout, range(0, 1), [], [], [mask])[0]
            outs.append(hidden[layout.origins[i]])
        return outs

    def chain_logits(self, aux: Tensor, next_tokens: Tensor, layout: ChainLayout) -> list[Tensor]:
        return [self.lm_head(self.norm(h)) for h in self.chain_hidden(aux, next_tokens, layout)]
