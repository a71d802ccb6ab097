"""Pieces shared by the model drafters: target features, the draft vocabulary, the Llama-style decoder blocks with their
own KV cache, the chain attention used in training, and the drafting life cycle every drafter follows.

Drafters never import the runtime: the engine (or the training pipeline) passes the target's hidden states in as
`TargetFeatures`, and the target's input embedding as a tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridspec.proposal import Proposal

# Maps raw next-token logits over the target vocabulary [V] to the sampling distribution [V]. The engine passes the
# verifier's own processing (temperature/top-k/top-p), so the drafter samples from exactly what the verifier assumes.
ProbsFn = Callable[[Tensor], Tensor]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 convention (vLLM's default too): the inputs of layers 2, L//2 and L-3."""
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 layers for EAGLE-style auxiliary hidden states, got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class TargetFeatures:
    """What a drafter needs from the target at n consecutive positions of one sequence.

    aux:   [n, len(aux_layer_ids) * H] the target's hidden states at the *inputs* of the drafter's aux layers,
           concatenated in layer-id order (HF `output_hidden_states[i]` is the input of layer i).
    final: [n, H] the target's final hidden state, after its final norm (what the target's lm_head reads).
    Row i belongs to the position whose output was the token that follows it (see `Drafter`).
    """

    aux: Tensor
    final: Tensor

    def __post_init__(self) -> None:
        if self.aux.dim() != 2 or self.final.dim() != 2 or self.aux.shape[0] != self.final.shape[0]:
            raise ValueError(f"TargetFeatures needs aux [n, kH] and final [n, H] with the same n, "
                             f"got {tuple(self.aux.shape)} and {tuple(self.final.shape)}")

    def __len__(self) -> int:
        return self.aux.shape[0]

    def __getitem__(self, index: slice) -> "TargetFeatures":
        return TargetFeatures(self.aux[index], self.final[index])

    @classmethod
    def from_hidden_states(cls, hidden_states: Sequence[Tensor], aux_layer_ids: Sequence[int]) -> "TargetFeatures":
        """From a Hugging Face `output_hidden_states` tuple (L+1 tensors, [T, H] or [1, T, H]) of one sequence."""
        num_layers = len(hidden_states) - 1
        bad = [i for i in aux_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside the target's {num_layers} layers")
        squeeze = (lambda t: t[0]) if hidden_states[0].dim() == 3 else (lambda t: t)
        aux = torch.cat([squeeze(hidden_states[i]) for i in aux_layer_ids], dim=-1)
        return cls(aux=aux, final=squeeze(hidden_states[-1]))

    @staticmethod
    def cat(parts: Sequence["TargetFeatures"]) -> "TargetFeatures":
        return TargetFeatures(torch.cat([p.aux for p in parts]), torch.cat([p.final for p in parts]))


@dataclass(frozen=True)
class TargetInfo:
    """The facts about a target that a drafter checkpoint must agree with."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: Any) -> "TargetInfo":
        """From a TargetInfo or anything shaped like a Hugging Face config (num_hidden_layers, hidden_size,
        vocab_size)."""
        if isinstance(config, TargetInfo):
            return config
        text = getattr(config, "get_text_config", None)
        config = text() if callable(text) else config
        return cls(int(config.num_hidden_layers), int(config.hidden_size), int(config.vocab_size))


def check_target(kind: str, *, target: TargetInfo, hidden_size: int, vocab_size: int,
                 aux_layer_ids: Sequence[int] = (), expected_aux_layer_ids: Sequence[int] | None = None) -> None:
    """Raise a ValueError naming every mismatch between a drafter and the target it is about to serve.

    Wrong auxiliary layer ids do not crash anything: they silently collapse acceptance, so they are checked here.
    """
    problems = []
    if hidden_size != target.hidden_size:
        problems.append(f"target hidden size {target.hidden_size} != drafter's target_hidden_size {hidden_size}")
    if vocab_size != target.vocab_size:
        problems.append(f"target vocabulary {target.vocab_size} != drafter's target vocabulary {vocab_size}")
    out_of_range = [i for i in aux_layer_ids if not 0 <= i < target.num_layers]
    if out_of_range:
        problems.append(f"aux layer ids {list(aux_layer_ids)} do not fit the target's {target.num_layers} layers")
    if expected_aux_layer_ids is not None and list(expected_aux_layer_ids) != list(aux_layer_ids):
        problems.append(f"the runtime captures layers {list(expected_aux_layer_ids)} but the drafter was trained on "
                        f"{list(aux_layer_ids)}")
    if problems:
        raise ValueError(f"{kind} drafter does not match its target: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------------------------------
# Draft vocabulary


def build_draft_vocab(token_counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent target tokens.

    Draft ids are ordered by target id, d2t is the offset table of the speculators format (target id = i + d2t[i]),
    t2d a boolean mask over the target vocabulary.
    """
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    # Ties broken by target id, so the same counts always give the same vocabulary.
    order = torch.argsort(token_counts.double() - torch.arange(vocab, dtype=torch.float64) / (2 * vocab),
                          descending=True)
    target_ids = torch.sort(order[:draft_vocab_size]).values
    d2t = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t.long(), t2d


# ---------------------------------------------------------------------------------------------------------------------
# Llama-style blocks (the names match the speculators/vLLM checkpoint layout)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Default (unscaled) rotary embedding, applied with rotate-half like Llama."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [heads, n, head_dim]; cos/sin: [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class LayerConfig:
    """The decoder-layer shape; mirrors the `transformer_layer_config` of a speculators checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def like_target(cls, config: Any, intermediate_size: int | None = None) -> "LayerConfig":
        """The target's attention shape and RoPE, with an optionally smaller MLP (a cheaper drafter)."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        heads = config.num_attention_heads
        return cls(hidden_size=config.hidden_size, intermediate_size=intermediate_size or config.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=getattr(config, "num_key_value_heads", heads),
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(theta),
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", 8192)))


class Attention(nn.Module):
    def __init__(self, cfg: LayerConfig, input_size: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [n, in] -> q [heads, n, d], k and v [kv_heads, n, d], with RoPE applied to q and k."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def expand_kv(self, t: Tensor) -> Tensor:
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)

    def out(self, attn: Tensor) -> Tensor:
        """attn: [heads, n, d] -> [n, hidden]."""
        return self.o_proj(attn.transpose(0, 1).reshape(attn.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, cfg: LayerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer; the first layer of an EAGLE-3/P-EAGLE drafter attends over cat(norm(emb), norm(h)) (2H)
    and keeps h itself (not normed, unless norm_before_residual) as the residual, as vLLM's llama_eagle3 does."""

    def __init__(self, cfg: LayerConfig, first: bool, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.first, self.norm_before_residual = first, norm_before_residual
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size if first else cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attn_input(self, h: Tensor, emb: Tensor | None) -> tuple[Tensor, Tensor]:
        """(attention input, residual) for hidden states h and (first layer only) token embeddings."""
        if not self.first:
            return self.input_layernorm(h), h
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        return torch.cat([self.input_layernorm(emb), normed], dim=-1), residual

    def finish(self, attn_out: Tensor, residual: Tensor) -> Tensor:
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax attention with grouped KV heads. q [heads, n, d], k/v [kv_heads, m, d], mask [n, m] bool (True =
    visible) or None (all). The g query heads of a KV head are folded into one product with its keys instead of
    copying the keys g times: 2-3x faster on a CPU at a few hundred slots, the drafters' case."""
    heads, n, d = q.shape
    kv_heads = k.shape[0]
    g = heads // kv_heads
    scores = torch.matmul(q.reshape(kv_heads, g * n, d), k.transpose(1, 2)) * d ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).view(heads, n, d)


def causal_mask(num_queries: int, num_past: int, device: torch.device | None = None) -> Tensor:
    """Query i (at absolute slot num_past + i) sees every slot up to and including itself."""
    q = torch.arange(num_queries, device=device)[:, None] + num_past
    return torch.arange(num_past + num_queries, device=device)[None, :] <= q


@dataclass
class KVCache:
    """Per-layer keys and values of the real (target-fed) slots, [kv_heads, S, d] each."""

    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)

    def __len__(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[1]

    def get(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        return (self.keys[layer], self.values[layer]) if layer < len(self.keys) else (None, None)

    def set(self, layer: int, k: Tensor, v: Tensor) -> None:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        self.keys[layer], self.values[layer] = k, v


# ---------------------------------------------------------------------------------------------------------------------
# Chain attention for training (P-EAGLE's parallel groups, EAGLE-3's training-time test)


@dataclass
class ChainLayout:
    """Where the training elements of a packed batch sit.

    Depth 0 is every real slot i (target hidden state of position i, the token after it). Depth d >= 1 holds a subset of
    origins (nested: depth d's origins are among depth d-1's), at position pos[i] + d, one step further down the chain
    from origin i. Element (i, d) attends to real slots j <= i of its own sequence and to (i, 1..d) of its own chain.
    """

    seq_id: Tensor            # [N] sequence of each real slot
    positions: Tensor         # [N] position of each real slot within its sequence
    origins: list[Tensor]     # origins[d]: [n_d] real-slot indices of depth d's elements (sorted; the EAGLE family
                              # needs every real slot at depth 0 as context, the LSTM may start from fewer)
    rank_in_depth: list[Tensor] = field(init=False)  # rank_in_depth[d][i]: index of origin i in depth d (-1: absent)

    def __post_init__(self) -> None:
        n = self.seq_id.numel()
        self.rank_in_depth = []
        for idx in self.origins:
            rank = torch.full((n,), -1, dtype=torch.long)
            rank[idx] = torch.arange(idx.numel())
            self.rank_in_depth.append(rank)

    def prefix_mask(self, depth: int) -> Tensor:
        """[n_d, N]: element (i, depth) sees real slot j iff same sequence and j <= i."""
        origin = self.origins[depth]
        j = torch.arange(self.seq_id.numel())
        return (self.seq_id[origin][:, None] == self.seq_id[None, :]) & (j[None, :] <= origin[:, None])

    def element_positions(self, depth: int) -> Tensor:
        return self.positions[self.origins[depth]] + depth


def sample_chain_origins(valid_depth: Tensor, max_depth: int, keep_ratio: float = 0.7, min_ratio: float = 0.2,
                         generator: torch.Generator | None = None, first: Tensor | None = None) -> list[Tensor]:
    """P-EAGLE's per-depth sampling: depth 0 keeps every real slot (or the slots `first`); depth d keeps about
    n * max(keep_ratio^d, min_ratio) origins, drawn from depth d-1's (so every kept chain is complete) among those
    whose chain reaches depth d.

    valid_depth[i]: how deep the chain from real slot i can go (its target exists up to there).
    """
    origins = [torch.arange(valid_depth.numel()) if first is None else first]
    n = origins[0].numel()
    for d in range(1, max_depth):
        previous = origins[-1]
        candidates = previous[valid_depth[previous] >= d]
        want = min(candidates.numel(), max(1, round(n * max(keep_ratio ** d, min_ratio))))
        if want == 0:
            break
        pick = torch.randperm(candidates.numel(), generator=generator)[:want]
        origins.append(torch.sort(candidates[pick]).values)
    return origins


def full_chain_origins(valid_depth: Tensor, max_depth: int, first: Tensor | None = None) -> list[Tensor]:
    """Every chain (from every real slot, or from the slots `first`) to every depth it reaches (evaluation, EAGLE-3's
    training-time test)."""
    origins = [torch.arange(valid_depth.numel()) if first is None else first]
    for d in range(1, max_depth):
        idx = origins[0][valid_depth[origins[0]] >= d]
        if idx.numel() == 0:
            break
        origins.append(idx)
    return origins


def chain_attention(attn: Attention, q: Tensor, layout: ChainLayout, depth: int, keys: list[Tensor],
                    values: list[Tensor], prefix_mask: Tensor) -> Tensor:
    """Attention of depth `depth`'s queries q [heads, n_d, d] over the real slots (keys[0]) and their own chain
    (keys[1..depth], one key per element; each keys[e] is [kv_heads, n_e, d]). Returns [heads, n_d, d].

    Costs O(n_d * (N + depth)) instead of the O((sum n_d)^2) of one dense mask over every element.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = attn.expand_kv(keys[0]), attn.expand_kv(values[0])
    scores = [torch.matmul(q, k0.transpose(1, 2)).masked_fill(~prefix_mask, float("-inf"))]
    chain_values = []
    for e in range(1, depth + 1):
        rows = layout.rank_in_depth[e][layout.origins[depth]]  # this chain's element at depth e
        ke, ve = attn.expand_kv(keys[e][:, rows]), attn.expand_kv(values[e][:, rows])
        scores.append((q * ke).sum(-1, keepdim=True))
        chain_values.append(ve)
    probs = torch.softmax(torch.cat(scores, dim=-1) * scale, dim=-1)
    out = torch.matmul(probs[..., : k0.shape[1]], v0)
    for e, ve in enumerate(chain_values):
        out = out + probs[..., k0.shape[1] + e: k0.shape[1] + e + 1] * ve
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The drafting life cycle


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
    [last committed token, a_1..a_n], [a_1..a_n, y])`. `propose(state, k)` drafts the k tokens that follow the last
    token given.
    """

    name: str = ""
    aux_layer_ids: tuple[int, ...] = ()
    default_speculative_tokens: int = 3

    def begin(self, features: TargetFeatures, tokens: Tensor | Sequence[int]) -> Any:
        state = self.new_state()
        self.accept(state, features, tokens)
        return state

    def new_state(self) -> Any:
        raise NotImplementedError

    def accept(self, state: Any, features: TargetFeatures, tokens: Tensor | Sequence[int]) -> None:
        raise NotImplementedError

    def propose(self, state: Any, k: int, probs_fn: ProbsFn | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        raise NotImplementedError

    def check_target(self, target: Any, aux_layer_ids: Sequence[int] | None = None) -> None:
        raise NotImplementedError


def as_token_tensor(tokens: Tensor | Sequence[int], n: int) -> Tensor:
    t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if t.numel() != n:
        raise ValueError(f"{t.numel()} tokens for {n} feature rows: pass one token per row (the token that row "
                         "produced)")
    return t


@dataclass
class _Track:
    state: Any       # the drafter's state, None until the first features arrive
    length: int      # tokens of the sequence seen: features of positions 0..length-2 went in with tokens 1..length-1
    last_token: int  # the sequence's last token (a request extending this one must continue from it)


class DrafterProposer:
    """The engine's face of a model drafter: the Proposer life cycle with the target's features passed in.

    start_request(rid, tokens, features=F): `tokens` is the whole prompt x_0..x_n; F holds the target's features at
    the positions before its last token, all of them (0..n-1) or the last len(F) only (the drafter's positions are
    relative: a shorter context drafts from less). With extends=rid0, a finished request whose tokens this prompt
    continues, and F starting where rid0's features ended (a session that reused its KV cache), rid0's drafter state
    is continued instead of rebuilt. append(rid, tokens, features=F): tokens = accepted draft tokens + the verifier's
    next token, F one row per token (the positions of the last committed token and the accepted drafts).
    speculate(rid, K) -> Proposal (chain). probs_fn None drafts greedily (temperature 0); for sampling, set it to the
    verifier's processing (e.g. functools.partial(process_logits, temperature=t, top_k=k, top_p=p)), so drafts come
    from the distribution the verifier assumes.
    """

    wants_target_features = True  # the engine passes features= to start_request and append
    prefers_trees = True  # the engine's default: one more guess per depth buys more than the chain's tail

    def __init__(self, drafter: Drafter, num_speculative_tokens: int | None = None, probs_fn: ProbsFn | None = None,
                 generator: torch.Generator | None = None, max_retained: int = 8, tree_width: int = 3) -> None:
        self.drafter, self.probs_fn, self.generator = drafter, probs_fn, generator
        self.num_speculative_tokens = num_speculative_tokens or drafter.default_speculative_tokens
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.tree_width = tree_width
        self.max_retained = max_retained
        self.live: dict[Hashable, _Track] = {}
        self.retained: dict[Hashable, _Track] = {}  # finished requests a later prompt may extend (oldest first)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.aux_layer_ids

    def set_sampling(self, probs_fn: ProbsFn | None, generator: torch.Generator | None) -> None:
        self.probs_fn, self.generator = probs_fn, generator

    @torch.inference_mode()
    def start_request(self, request_id: Hashable, tokens: Sequence[int], *, features: TargetFeatures,
                      extends: Hashable | None = None) -> None:
        if request_id in self.live:
            raise KeyError(f"request {request_id!r} is already running")
        if len(features) >= len(tokens):
            raise ValueError(f"{len(features)} feature rows for a prompt of {len(tokens)} tokens: pass one row per "
                             "position before the prompt's last token")
        first = len(tokens) - 1 - len(features)  # position of the first feature row
        previous = self.retained.pop(extends, None) if extends is not None else None
        if previous is not None and previous.length == first + 1 and tokens[first] == previous.last_token:
            track = previous
        else:
            track = _Track(None, first + 1, int(tokens[first]))
        self.live[request_id] = track
        if len(features):
            self._accept(track, features, list(tokens[first + 1:]))

    def _accept(self, track: _Track, features: TargetFeatures, tokens: Sequence[int]) -> None:
        if track.state is None:
            track.state = self.drafter.begin(features, tokens)
        else:
            self.drafter.accept(track.state, features, tokens)
        track.length += len(tokens)
        track.last_token = int(tokens[-1])

    @torch.inference_mode()
    def append(self, request_id: Hashable, tokens: Sequence[int], *, features: TargetFeatures) -> None:
        if len(tokens):
            self._accept(self.live[request_id], features, tokens)

    @torch.inference_mode()
    def speculate(self, request_id: Hashable, max_spec_tokens: int | None = None, tree: bool = False) -> Proposal:
        """A chain of max_spec_tokens drafts; tree=True: a tree of at most max_spec_tokens nodes, the greedy chain with
        `tree_width - 1` siblings per depth (`widen_chain`), the chain no deeper than the drafter's K nor than
        max_spec_tokens / tree_width (the depths a budget of that many nodes fills)."""
        k = self.num_speculative_tokens if max_spec_tokens is None else max_spec_tokens
        state = self.live[request_id].state
        if k <= 0 or state is None:  # nothing to draft from yet: a one-token prompt before its first step
            return Proposal.empty(self.drafter.name)
        if tree:
            chain = self.drafter.propose(state, min(-(-k // self.tree_width), self.num_speculative_tokens))
            return widen_chain(chain, self.tree_width, k)
        return self.drafter.propose(state, k, self.probs_fn, self.generator)

    def finish_request(self, request_id: Hashable) -> None:
        track = self.live.pop(request_id, None)
        if track is not None and self.max_retained > 0:
            self.retained[request_id] = track
            while len(self.retained) > self.max_retained:
                del self.retained[next(iter(self.retained))]

    def abort_request(self, request_id: Hashable) -> None:
        self.live.pop(request_id, None)


# ---------------------------------------------------------------------------------------------------------------------
# The EAGLE family (EAGLE-3 and P-EAGLE share everything but how the K drafts are produced)


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
    speculative_tokens: int = 3       # the default K recorded in the checkpoint

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.target_vocab_size}, got {self.draft_vocab_size}")


@dataclass
class EagleState:
    """One sequence's drafting state: KV of the real slots already run, the real slots waiting for the next pass, and
    the outputs of the last real slot (so `propose` can be called again without new tokens)."""

    kv: KVCache = field(default_factory=KVCache)
    num_slots: int = 0                      # real slots run or pending; the next real slot's position
    pending_aux: list[Tensor] = field(default_factory=list)
    pending_tokens: list[Tensor] = field(default_factory=list)
    last_logits: Tensor | None = None       # [draft_vocab] of the last real slot
    last_hidden: Tensor | None = None       # [H] pre-norm output of the last real slot (EAGLE-3 feeds it back)


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
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer, first=i == 0, norm_before_residual=cfg.norm_before_residual)
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
    def default_speculative_tokens(self) -> int:
        return self.config.speculative_tokens

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

    def forward_slots(self, kv: KVCache, hidden: Tensor, tokens: Tensor, positions: Tensor, keep: int) -> Tensor:
        """Run the layers over n new slots (hidden [n, H] already in drafter space, tokens [n]), attending to the slots
        in `kv` and causally to each other; the first `keep` new slots' keys and values are appended to `kv`.
        Returns the pre-norm outputs [n, H]."""
        param = self.lm_head.weight
        h, emb = hidden.to(param.dtype), self.embed_tokens(tokens.to(param.device)).to(param.dtype)
        cos, sin = self.rotary(positions.to(param.device))
        past = len(kv)
        mask = causal_mask(h.shape[0], past, device=h.device)
        for i, layer in enumerate(self.layers):
            x, residual = layer.attn_input(h, emb if layer.first else None)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            pk, pv = kv.get(i)
            if pk is not None:
                k, v = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
            attn = layer.self_attn
            out = attend(q, k, v, mask)
            h = layer.finish(attn.out(out), residual)
            if keep:
                kv.set(i, k[:, : past + keep], v[:, : past + keep])
        return h

    def run_pending(self, state: EagleState, extra_hidden: Tensor | None = None, extra_tokens: Tensor | None = None
                    ) -> Tensor | None:
        """Run the pending real slots (committing their KV) together with optional extra slots that follow them
        (not committed) in one forward pass; returns the pre-norm outputs of the extra slots."""
        if not state.pending_tokens:
            if state.last_logits is None:
                raise RuntimeError("propose() before any features were given: call begin() first")
            if extra_hidden is None:
                return None
            return self.forward_slots(KVCache(list(state.kv.keys), list(state.kv.values)), extra_hidden, extra_tokens,
                                      torch.arange(extra_tokens.numel()) + state.num_slots, keep=0)
        param = self.fc.weight
        aux = torch.cat(state.pending_aux).to(param.device, param.dtype)
        tokens = torch.cat(state.pending_tokens)
        first = state.num_slots - tokens.numel()
        hidden, n_real = self.fc(aux), tokens.numel()
        if extra_hidden is not None:
            hidden, tokens = torch.cat([hidden, extra_hidden]), torch.cat([tokens, extra_tokens])
        out = self.forward_slots(state.kv, hidden, tokens, torch.arange(tokens.numel()) + first, keep=n_real)
        state.last_hidden = out[n_real - 1]
        state.last_logits = self.lm_head(self.norm(state.last_hidden))
        state.pending_aux.clear()
        state.pending_tokens.clear()
        return out[n_real:] if extra_hidden is not None else None

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
