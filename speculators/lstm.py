"""Arctic-style LSTM speculator (ArcticInference `method: "arctic"`, `sum_lstm` with tied weights and tied embeddings).

Input: the last token and the target's final hidden state at the position before it. Head i:
    states = proj(prev) + (emb_w / state_w) * emb(token) (the embedding repeated for the 4 gates)
    forget, input, output = sigmoid(...); candidate = GELU(cell_ln(...)) * input
    cell = cell * forget + candidate;  state = GELU(state_ln(cell)) * output;  logits = head(state)
The argmax (or sample) of head i is head i+1's token; proj is projs[0] (target hidden -> 4D) for head 0 and projs[1]
(D -> 4D) after it, and one embedding, cell_ln, state_ln and head serve every head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridspec.proposal import Proposal
from hybridspec.speculators.chains import ChainLayout
from hybridspec.speculators.drafter import Drafter, ProbsFn, as_token_tensor, chain_proposal, draft_token
from hybridspec.speculators.features import TargetFeatures, TargetInfo, check_target


@dataclass
class LSTMConfig:
    input_hidden_dim: int  # the target's hidden size
    dim: int               # inner_dim = proj_dim = emb_dim (sum_lstm with tied embeddings needs them equal)
    vocab_size: int        # the target's vocabulary
    num_speculative_tokens: int = 3  # heads trained (the Arctic format's n_predict)
    scale_input: bool = True

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.num_speculative_tokens)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight ** 2) * (self.dim / 2))


class ScaledNorm(nn.Module):
    """Arctic's MLPSpeculatorLayerNorm: RMS normalisation with an optional elementwise scale and shift."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.affine = eps, affine
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + self.bias if self.affine else x


@dataclass
class LSTMState:
    hidden: Tensor | None = None  # [H] target final hidden state before the last token
    token: int = -1


class LSTMDrafter(Drafter):
    name = "lstm"

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__()
        self.config = c = config
        d = c.dim
        # ModuleLists of one, as Arctic names them (forget_emb.0, projs.0/1, cell_ln.0, state_ln.0, head.0).
        self.forget_emb = nn.ModuleList([nn.Embedding(c.vocab_size, d)])
        self.projs = nn.ModuleList([nn.Linear(c.input_hidden_dim, 4 * d, bias=False), nn.Linear(d, 4 * d, bias=False)])
        self.cell_ln = nn.ModuleList([ScaledNorm(d)])
        self.state_ln = nn.ModuleList([ScaledNorm(d)])
        self.head = nn.ModuleList([nn.Linear(d, c.vocab_size, bias=False)])
        self.ln0 = ScaledNorm(c.input_hidden_dim, affine=False)
        nn.init.normal_(self.forget_emb[0].weight, std=1.0 / math.sqrt(d))
        for proj in self.projs:
            nn.init.normal_(proj.weight, std=1.0 / math.sqrt(proj.in_features))
        nn.init.normal_(self.head[0].weight, std=1.0 / math.sqrt(d))

    def step(self, prev: Tensor, cell: Tensor, tokens: Tensor, head_index: int) -> tuple[Tensor, Tensor]:
        """One head: (state, cell) from the previous state [n, H or D], cell [n, D] and tokens [n]."""
        c = self.config
        if head_index == 0 and c.scale_input:
            prev = self.ln0(prev) / math.sqrt(2)
        z = self.forget_emb[0](tokens).repeat(1, 4)
        gates = self.projs[min(head_index, 1)](prev) + z * (c.emb_weight / c.state_weight)
        forget_input_output, candidate = gates.split([3 * c.dim, c.dim], dim=-1)
        forget, input_gate, output = torch.sigmoid(forget_input_output).chunk(3, dim=-1)
        cell = cell * forget + F.gelu(self.cell_ln[0](candidate)) * input_gate
        return F.gelu(self.state_ln[0](cell)) * output, cell

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def check_target(self, target: Any, aux_layer_ids: Sequence[int] | None = None) -> None:
        check_target(self.name, target=TargetInfo.of(target), hidden_size=self.config.input_hidden_dim,
                     vocab_size=self.config.vocab_size)

    # -- inference ---------------------------------------------------------------------------------------------------

    def new_state(self) -> LSTMState:
        return LSTMState()

    def accept(self, state: LSTMState, features: TargetFeatures, tokens: Tensor | Sequence[int]) -> None:
        tokens = as_token_tensor(tokens, len(features))
        if features.final.shape[-1] != self.config.input_hidden_dim:
            raise ValueError(f"final hidden states have width {features.final.shape[-1]}, the drafter expects "
                             f"{self.config.input_hidden_dim}")
        state.hidden, state.token = features.final[-1], int(tokens[-1])

    @torch.inference_mode()
    def propose(self, state: LSTMState, num_speculative_tokens: int, probs_fn: ProbsFn | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """That many heads (weights are tied, so it may exceed the config's num_speculative_tokens; heads past it
        were not trained)."""
        if state.hidden is None:
            raise RuntimeError("propose() before any features were given: call begin() first")
        weight = self.head[0].weight
        prev = state.hidden.to(weight.device, weight.dtype)[None]
        cell = prev.new_zeros(1, self.config.dim)
        token = state.token
        tokens, probs, full = [], [], []
        for i in range(num_speculative_tokens):
            prev, cell = self.step(prev, cell, torch.tensor([token], device=weight.device), i)
            logits = self.head[0](prev)[0].float()
            token, prob = draft_token(logits, probs_fn, generator)
            tokens.append(token)
            probs.append(prob)
            full.append(logits)
        return chain_proposal(tokens, probs, torch.stack(full), self.name)

    # -- training ----------------------------------------------------------------------------------------------------

    def chain_logits(self, final: Tensor, next_tokens: Tensor, layout: ChainLayout) -> list[Tensor]:
        """Head d's logits [n_d, vocab] for each origin of depth d, teacher-forced with the real tokens."""
        prev = final[layout.origins[0]]
        cell = prev.new_zeros(prev.shape[0], self.config.dim)
        logits = []
        for d, origins in enumerate(layout.origins):
            if d > 0:
                rows = layout.rank_in_depth[d - 1][origins]
                prev, cell = prev[rows], cell[rows]
            prev, cell = self.step(prev, cell, next_tokens[origins + d], d)
            logits.append(self.head[0](prev))
        return logits
