"""What goes into a target forward pass and what comes out of it. A caller describes one cache's part of a
verification pass as a `StepInput` (each row's last committed token, its draft chain or tree, and optionally a prompt
chunk run first in the same row); `step_part` turns each into a `ForwardPart` (the [b, q] tokens with their position
offsets and tree mask), runs all parts of a pass at once, and returns a `StepOutput` per part: the logits, and on
request the hidden states that drafters read, including `drafter_features`, the target features at a prompt's last
`drafter_context` positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hybridspec.model.kv_cache import KVCache, tree_depths_and_mask


@dataclass
class StepOutput:
    """Result of one forward pass over [B, q] input tokens."""

    logits: torch.Tensor  # [B, q, V] (prefill: [B, 1, V], at each row's last new token)
    aux_hidden: torch.Tensor | None = None  # [B, q, 3H]: inputs of the aux_layer_ids layers, concatenated
    final_hidden: torch.Tensor | None = None  # [B, q, H]: the final hidden state after the model's last norm
    # With drafter_context=n (prefill, StepInput): per row, (aux, final) at the last min(n, new tokens) prompt positions
    drafter_features: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def with_rows(self, other: "StepOutput", rows: torch.Tensor) -> "StepOutput":
        """This output with the rows where `rows` [B] is True taken from `other`."""
        def pick(mine, theirs):
            return None if mine is None else torch.where(rows[:, None, None], theirs, mine)

        return StepOutput(pick(self.logits, other.logits), pick(self.aux_hidden, other.aux_hidden),
                          pick(self.final_hidden, other.final_hidden))


@dataclass
class ForwardPart:
    """One cache's rows in a forward pass: [b, q] input tokens at slots lengths[r] + i of its rows. The parts of a pass
    may differ in q (a prefill chunk beside decode steps): their linear layers run over all their inputs at once, packed
    without padding, and each part attends over its own cache.

    depths [b, q]: each input's position offset from its row's length (a chain: 0..q-1; a tree: node depth).
    tree_mask [b, q, q] bool: input i attends to input j of the same row (ancestor-or-self; padding: self only).
    causal: every row's inputs are q consecutive tokens (a prefill chunk, no padding): tree_mask is causal.
    output_index [b, n]: outputs (logits, hidden states) at these n inputs of each row only (None: at every input;
    n = 0: none, a prefill chunk whose outputs nobody reads).
    features_index [m] (one row): the hidden states at these inputs too, as the output's drafter_features (a drafter's
    prompt context, from a prompt chunk).
    causal_rows (one row): its first causal_rows inputs are consecutive tokens (a prompt chunk before a draft tree):
    they attend causally without a mask, the rest by tree_mask; the mask then spans the rest only.
    token_masks: see `StepInput`.
    prompt_lengths (per row) and node_parents [b, n]: what linear-attention layers need to know: a row's first
    prompt_lengths[r] inputs are prompt tokens (kept whatever happens), its last n inputs are step nodes, each with its
    parent among them (-1: the row's committed tokens).
    """

    cache: KVCache
    tokens: torch.Tensor
    depths: torch.Tensor
    tree_mask: torch.Tensor
    causal: bool = False
    output_index: torch.Tensor | None = None
    features_index: torch.Tensor | None = None
    causal_rows: int = 0
    token_masks: torch.Tensor | None = None  # [b, n, V / 32] int32: the tokens each output may be (bits; a grammar's)
    prompt_lengths: Sequence[int] | None = None
    node_parents: torch.Tensor | None = None


@dataclass
class StepInput:
    """One cache's part of a verification pass (`TargetModel.step_many`): row r gets [last_tokens[r]] + drafts[r]
    (a tree when parents[r] is given). prompt: a one-row cache's uncached prompt tokens, run first in the same row (a
    prefill chunk; they go into the cache); with no last token the part is that chunk alone. drafter_context: the
    target features at the prompt's last drafter_context tokens come back as the output's drafter_features (with
    return_hidden). token_masks: a grammar's allowed tokens at each of a row's outputs (bit t % 32 of word t // 32),
    which a greedy pass's output layer (`GreedyHead`) takes its maximum over; the logits are not masked otherwise."""

    cache: KVCache
    last_tokens: Sequence[int]
    drafts: Sequence[Sequence[int]] = ()
    parents: Sequence[Sequence[int] | None] | None = None
    prompt: Sequence[int] = ()
    drafter_context: int = 0
    token_masks: Sequence[torch.Tensor | None] | None = None  # per row: [1 + len(draft), V / 32] bits, or None


def step_part(step: StepInput, vocab_size: int, device: torch.device) -> ForwardPart:
    """A StepInput's rows: [prompt] + [last token] + draft, padded to the longest row (padding sees only itself)."""
    cache, prompt = step.cache, list(step.prompt)
    if len(step.last_tokens) != cache.batch_size and not (prompt and not step.last_tokens):
        raise ValueError(f"got {len(step.last_tokens)} rows for a cache of {cache.batch_size}")
    if prompt and cache.batch_size != 1:
        raise ValueError(f"prompt tokens go with a one-row cache, got {cache.batch_size} rows")
    drafts = [list(d) for d in step.drafts] if step.drafts else [[] for _ in step.last_tokens]
    parents = list(step.parents) if step.parents is not None else [None] * len(drafts)
    if not len(drafts) == len(parents) == len(step.last_tokens):
        raise ValueError(f"{len(step.last_tokens)} rows, {len(drafts)} drafts, {len(parents)} parent lists")
    width = len(prompt)
    q = width + (1 + max(map(len, drafts)) if drafts else 0)
    rows = max(1, len(drafts))
    tokens = torch.zeros(rows, q, dtype=torch.long)
    depths = torch.zeros(rows, q, dtype=torch.long)
    tree_mask = torch.eye(q, dtype=torch.bool).repeat(rows, 1, 1)
    node_parents = torch.full((rows, q - width), -1, dtype=torch.long)  # padding: as if a first node
    if prompt:  # the prompt's chunk is causal, and every step input sees all of it
        tokens[0, :width] = torch.as_tensor(prompt, dtype=torch.long)
        depths[0, :width] = torch.arange(width)
        tree_mask[0, :, :width] = torch.ones(q, width, dtype=torch.bool).tril()
    causal = True
    for b, (last, draft, row_parents) in enumerate(zip(step.last_tokens, drafts, parents)):
        n = len(draft)
        chain = row_parents is None or list(row_parents) == list(range(-1, n - 1))
        row_parents = list(row_parents) if row_parents is not None else list(range(-1, n - 1))
        if len(row_parents) != n:
            raise ValueError(f"row {b}: {n} draft tokens but {len(row_parents)} parents")
        causal = causal and chain and width + 1 + n == q
        depth, mask = tree_depths_and_mask(row_parents)
        tokens[b, width] = int(last)
        tokens[b, width + 1:width + n + 1] = torch.as_tensor(draft, dtype=torch.long)
        depths[b, width:width + n + 1] = width + torch.as_tensor(depth)
        tree_mask[b, width:width + n + 1, width:width + n + 1] = mask
        node_parents[b, 1:n + 1] = torch.as_tensor(row_parents, dtype=torch.long) + 1
    if int(tokens.max()) >= vocab_size or int(tokens.min()) < 0:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    if not 0 <= step.drafter_context <= width:
        raise ValueError(f"drafter_context {step.drafter_context} for a prompt chunk of {width} tokens")
    output_index = torch.arange(width, q)[None].expand(rows, q - width) if prompt else None
    token_masks = None
    if step.token_masks is not None and any(m is not None for m in step.token_masks):
        words = next(m for m in step.token_masks if m is not None).shape[-1]
        token_masks = torch.full((rows, q - width, words), -1, dtype=torch.int32)  # -1: every token allowed
        for b, m in enumerate(step.token_masks):
            if m is not None:
                token_masks[b, :m.shape[0]] = m[:q - width]
    return ForwardPart(cache, tokens.to(device), depths.to(device), tree_mask.to(device),
                       causal=causal and bool(prompt),  # a step alone attends by its mask (Attention's folding)
                       causal_rows=width if prompt and not causal else 0,
                       output_index=None if output_index is None else output_index.to(device),
                       features_index=torch.arange(width - step.drafter_context, width, device=device)
                       if step.drafter_context else None,
                       token_masks=None if token_masks is None else token_masks.to(device),
                       prompt_lengths=[width] if prompt else None,
                       node_parents=node_parents if step.last_tokens else None)
