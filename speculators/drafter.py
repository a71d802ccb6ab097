"""The drafting life cycle every model drafter follows (`Drafter`), and how a drafter's next-token logits become
draft tokens and a `Proposal` (a chain, or a chain widened into a tree).

Drafters never import the runtime: the engine (or the training pipeline) passes the target's hidden states in as
`TargetFeatures`, and the target's input embedding as a tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from hybridspec.proposal import Proposal
from hybridspec.speculators.features import TargetFeatures

# Maps raw next-token logits over the target vocabulary [V] to the sampling distribution [V]. The engine passes the
# verifier's own processing (temperature/top-k/top-p), so the drafter samples from exactly what the verifier assumes.
ProbsFn = Callable[[Tensor], Tensor]


def draft_token(logits: Tensor, probs_fn: ProbsFn | None, generator: torch.Generator | None) -> tuple[int, float]:
    """(token, its probability under the drafter) from next-token logits [V]: argmax when probs_fn is None (greedy),
    else a sample from probs_fn(logits) (full-vocabulary logits then: the distribution the verifier will compute)."""
    probs = torch.softmax(logits.float(), dim=-1) if probs_fn is None else probs_fn(logits)
    token = int(torch.argmax(logits)) if probs_fn is None else int(torch.multinomial(probs, 1, generator=generator))
    return token, float(probs[token])


def chain_proposal(tokens: list[int], token_probs: list[float], draft_logits: Tensor, source: str) -> Proposal:
    """A chain whose probs are the drafter's cumulative probabilities (chance the path up to i survives, by its own
    estimate), so score = their sum = the expected number of accepted tokens."""
    cumulative, p = [], 1.0
    for q in token_probs:
        p *= q
        cumulative.append(p)
    return Proposal.chain(tokens, probs=cumulative, source=source, draft_logits=draft_logits)


def widen_chain(chain: Proposal, width: int, max_nodes: int) -> Proposal:
    """A greedy chain grown into a tree: at each depth the drafter's next `width - 1` most probable tokens become leaf
    siblings of the chain's token, and the `max_nodes` most probable nodes are kept.

    The first draft token is the one most often rejected and its runner-up is often the target's choice, so a few
    siblings buy more than the chain's tail at almost no cost where verification is bound by weights, not tokens.
    A sibling's prob is its path probability, the chain's up to its parent times its own, so the router can trim the
    tree like any other. Deterministic (no draft_logits): under sampling the verifier's one-hot rule keeps it lossless.
    """
    n = len(chain)
    if n == 0 or max_nodes <= 0:
        return Proposal.empty(chain.source)
    logits = chain.draft_logits.float()
    top_logits, top_ids = logits.topk(min(width, logits.shape[-1]), dim=-1)
    # p(sibling) / p(chain token) at each depth, from logits alone (the softmax's normaliser cancels); a sibling's path
    # probability is then the chain node's times that ratio
    chain_ids = torch.tensor(chain.token_ids, device=logits.device)
    ratio = (top_logits - logits.gather(1, chain_ids[:, None])).exp()
    # (path prob, depth, is sibling, token, parent's chain index) of every candidate node
    nodes = [(p, d, 0, t, d - 1) for d, (t, p) in enumerate(zip(chain.token_ids, chain.probs))]
    for d, (rs, ts) in enumerate(zip(ratio.tolist(), top_ids.tolist())):
        nodes += [(chain.probs[d] * r, d, 1, t, d - 1) for r, t in zip(rs, ts) if t != chain.token_ids[d] and r > 0]
    # most probable first (a parent's path prob is never below its child's; ties go to the shallower node, the
    # parent), then parents before children
    kept = sorted(sorted(nodes, key=lambda x: (-x[0], x[1], x[2]))[:max_nodes], key=lambda x: (x[1], x[2]))
    chain_index = {d: i for i, (_, d, sibling, _, _) in enumerate(kept) if not sibling}
    return Proposal(token_ids=[t for _, _, _, t, _ in kept],
                    parents=[chain_index[parent] if parent >= 0 else -1 for _, _, _, _, parent in kept],
                    probs=[p for p, *_ in kept], score=float(sum(p for p, *_ in kept)), source=chain.source)


class Drafter(nn.Module):
    """A model drafter: the engine hands it the target's features as tokens are committed and asks for K tokens.

    Alignment: every call passes `tokens` and `features` with one row per token, where features[i] is the target's
    state at the position whose output was tokens[i] (the position just before it). So, for a prompt x_0..x_{T-1} whose
    prefill produced x_T: `begin(features of positions 0..T-1, [x_1..x_T])`; after a verification step that accepted n
    draft tokens a_1..a_n and produced the next token y: `accept(state, features of the positions of
    [last committed token, a_1..a_n], [a_1..a_n, y])`. `propose(state, num_speculative_tokens)` drafts that many tokens
    following the last token given (`propose_many`: for several states at once); the attribute `num_speculative_tokens`
    is the drafter's default budget (its K).
    """

    name: str = ""
    aux_layer_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 3

    def begin(self, features: TargetFeatures, tokens: Tensor | Sequence[int]) -> Any:
        state = self.new_state()
        self.accept(state, features, tokens)
        return state

    def new_state(self) -> Any:
        raise NotImplementedError

    def accept(self, state: Any, features: TargetFeatures, tokens: Tensor | Sequence[int]) -> None:
        raise NotImplementedError

    def propose(self, state: Any, num_speculative_tokens: int, probs_fn: ProbsFn | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        raise NotImplementedError

    def propose_many(self, states: Sequence[Any], num_speculative_tokens: Sequence[int],
                     probs_fn: ProbsFn | None = None, generator: torch.Generator | None = None) -> list[Proposal]:
        """`propose` for several sequences; a drafter that runs them in one pass overrides it."""
        return [self.propose(s, k, probs_fn, generator) for s, k in zip(states, num_speculative_tokens)]

    def check_target(self, target: Any, aux_layer_ids: Sequence[int] | None = None) -> None:
        raise NotImplementedError


def as_token_tensor(tokens: Tensor | Sequence[int], n: int) -> Tensor:
    t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if t.numel() != n:
        raise ValueError(f"{t.numel()} tokens for {n} feature rows: pass one token per row (the token that row "
                         "produced)")
    return t
