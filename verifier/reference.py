"""Torch reference of the verification rules, in the batched form the Triton kernels implement.

Every rule works on a batch of B sequences padded to N draft nodes:
  draft_tokens [B, N] int, parents [B, N] int (-1 = child of the last committed token, parents precede children),
  num_nodes [B] int (nodes past num_nodes[b] are padding and never read).
Target rows are [B, N + 1, ...]: row 0 follows the last committed token, row 1 + i follows draft node i, so the target's
distribution *at* node i's position (the one node i's token is judged against) is row parents[i] + 1.

The randomness is an input (uniforms for the accept tests, exponential-race weights for the final token) so the kernels
in `kernels.py` can be compared with these functions exactly. The scalar arithmetic of the accept test runs in float32
here, as in the kernels; only the residual masses are sums whose reduction order may differ (relevant only in trees, and
only when a uniform lands within an ulp of its threshold).

This module is also the CPU implementation `verify_batch` uses: the per-sequence walks are short Python loops over at
most N nodes, and the O(V) work (a residual after a rejection, the final draw) is vectorised.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridspec.errors import InvalidParameter

# A residual max(0, p - q) with less mass than this is rounding noise of two (numerically) equal distributions: use p.
RESIDUAL_EPS = 2.0 ** -20  # exactly representable, so float32 and float64 comparisons agree


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] after temperature, top-k and top-p (in that order).

    temperature 0 is greedy: a one-hot distribution on the (first) argmax. top_k 0 (or >= V) keeps every token; top_p 1
    keeps every token; otherwise the most likely tokens are kept until their mass reaches top_p (at least one token).
    Both keep ties: a token exactly as likely as the last one kept is kept too, so the result never depends on how
    equal values happen to be ordered.
    """
    check_sampling_params(temperature, top_k, top_p)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dimension, got shape {tuple(logits.shape)}")
    logits = logits.float()
    if temperature == 0:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        probs = probs.masked_fill(probs < _top_p_threshold(probs, top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _top_p_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., 1]: the probability of the least likely token in the smallest most-likely set with mass >= top_p.

    A full sort of the vocabulary is slow on CPU (a step's worth of time at SmolLM2's vocabulary); LM distributions put
    top_p of their mass on few tokens, so look at the top 64 first and widen only while some row has not reached top_p.
    topk and sort give the same descending values, so the threshold does not depend on which width found it.
    """
    vocab = probs.shape[-1]
    width = min(vocab, 64)
    while True:
        top = probs.topk(width, dim=-1).values if width < vocab else probs.sort(dim=-1, descending=True).values
        mass = top.cumsum(-1)
        if width == vocab or bool((mass[..., -1] >= top_p).all()):
            break
        width = width * 8 if width * 8 <= vocab // 4 else vocab
    needed = (mass < top_p).sum(-1, keepdim=True).clamp_max(width - 1)  # index of the token that reaches top_p
    return top.gather(-1, needed)


def check_sampling_params(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature >= 0:  # also rejects NaN
        raise InvalidParameter(f"temperature must be >= 0 (0 = greedy), got {temperature}", "temperature")
    if top_k < 0:
        raise InvalidParameter(f"top_k must be >= 0 (0 = disabled), got {top_k}", "top_k")
    if not 0.0 < top_p <= 1.0:
        raise InvalidParameter(f"top_p must be in (0, 1], got {top_p}", "top_p")


def greedy_walk(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance for chains and trees.

    From the root, repeatedly move to the first child (lowest index) whose token equals the target's argmax at the
    current node; stop when none does. target_argmax: [B, N + 1].
    Returns path [B, N] int32 (accepted node indices root to leaf, padded with -1), accept_len [B] int32 and
    next_token [B] int64 (the target's argmax after the accepted path), on target_argmax's device.
    """
    num_draft = target_argmax.shape[1] - 1
    paths, next_tokens = [], []
    for targets, tokens, pars, n in zip(target_argmax.tolist(), draft_tokens.tolist(), parents.tolist(),
                                        num_nodes.tolist()):
        cur, accepted = -1, []
        # Children follow their parent, so one scan in index order finds the first matching child of each accepted node.
        for j in range(n):
            if pars[j] == cur and tokens[j] == targets[cur + 1]:
                accepted.append(j)
                cur = j
        paths.append(accepted)
        next_tokens.append(targets[cur + 1])
    device = target_argmax.device
    return (_pad_paths(paths, num_draft, device), _int32([len(p) for p in paths], device),
            torch.tensor(next_tokens, dtype=torch.int64, device=device))


def rejection_walk(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                   parents: torch.Tensor, num_nodes: torch.Tensor, uniforms: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling over chains and trees (recursive rejection over siblings; a chain is a tree with one
    child per node).

    target_probs [B, N + 1, V] and draft_probs [B, N, V] are processed distributions (`process_logits`);
    draft_probs[b, i] is the distribution node i's token was drawn from; None means every draft is deterministic
    (one-hot q).
    uniforms [B, N] in [0, 1): the accept test of node i uses uniforms[b, i].

    At the current node with residual r (unnormalised, mass S; r = the target row and S = 1 on arrival) the children are
    tried in index order: child i with token x is accepted iff u_i * q_i(x) * S < r(x), i.e. with probability
    min(1, p_res(x) / q_i(x)); on rejection r <- max(0, r - S * q_i) and S <- sum(r), or, when that mass is numerically
    zero, r <- the target row again.
    Returns path [B, N] int32 (-1 padded), accept_len [B] int32, final_row [B] int32 (the target row after the accepted
    path), use_residual [B] int32 (1: draw the next token from residual[b], 0: from target_probs[b, final_row[b]]) and
    residual [B, V] float32 (meaningful only where use_residual), on target_probs' device.
    """
    batch, num_rows, vocab = target_probs.shape
    device = target_probs.device
    tokens = draft_tokens.long().to(device).clamp(0, vocab - 1)  # padding may hold anything; it is never used
    rows = parents.long().to(device).clamp(-1, num_rows - 2) + 1
    # p and q at every node's own token, gathered once: the walk touches O(V) data only after a rejection.
    p_fresh = target_probs[torch.arange(batch, device=device)[:, None], rows, tokens].cpu().numpy()
    q_token = (np.ones((batch, num_rows - 1), dtype=np.float32) if draft_probs is None
               else draft_probs.gather(2, tokens[:, :, None]).squeeze(2).cpu().numpy())
    uniforms = uniforms.float().cpu().numpy()
    residual = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
    paths, final_rows, use_residual = [], [], []
    for b, (toks, pars, n) in enumerate(zip(draft_tokens.tolist(), parents.tolist(), num_nodes.tolist())):
        cur, mass, fresh, accepted = -1, np.float32(1.0), True, []
        for j in range(n):
            if pars[j] != cur:
                continue
            x = toks[j]
            p_x = p_fresh[b, j] if fresh else residual[b, x].cpu().numpy()
            if uniforms[b, j] * q_token[b, j] * mass < p_x:
                accepted.append(j)
                cur, mass, fresh = j, np.float32(1.0), True
                continue
            source = target_probs[b, cur + 1] if fresh else residual[b]
            if draft_probs is None:
                q = torch.zeros(vocab, dtype=torch.float32, device=device)
                q[x] = 1.0
            else:
                q = draft_probs[b, j]
            torch.clamp_min(source - torch.tensor(mass, device=device) * q, 0.0, out=residual[b])
            new_mass = residual[b].sum().cpu().numpy()
            mass, fresh = (np.float32(1.0), True) if new_mass <= RESIDUAL_EPS else (new_mass, False)
        paths.append(accepted)
        final_rows.append(cur + 1)
        use_residual.append(0 if fresh else 1)
    return (_pad_paths(paths, num_rows - 1, device), _int32([len(p) for p in paths], device),
            _int32(final_rows, device), _int32(use_residual, device), residual)


def race_sample(target_probs: torch.Tensor, final_row: torch.Tensor, use_residual: torch.Tensor, residual: torch.Tensor,
                race_weights: torch.Tensor) -> torch.Tensor:
    """Draw the next token (correction or bonus) per sequence by an exponential race: argmax_v r(v) * w(v).

    With w = 1 / E, E ~ Exp(1) i.i.d., argmax r(v) / E(v) is a draw from r / sum(r): no normalisation is needed and the
    result is exact given w. r is residual[b] where use_residual[b], else target_probs[b, final_row[b]]. Ties go to the
    lower token id. Returns [B] int64.
    """
    batch = target_probs.shape[0]
    rows = target_probs[torch.arange(batch, device=target_probs.device), final_row.long()]
    source = torch.where(use_residual.bool()[:, None], residual, rows)
    return (source * race_weights).argmax(-1)


def _pad_paths(paths: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    padded = [p + [-1] * (width - len(p)) for p in paths]
    return torch.tensor(padded, dtype=torch.int32, device=device).view(len(paths), width)


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)
