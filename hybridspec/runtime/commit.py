"""The commit rules: which of a step's verified tokens a sequence keeps, why it ends, and how much it may draft.

Shared by the engine and the vLLM plugin (which must feed its suffix cache exactly what the engine would commit).
A cut depends only on the token stream, never on how many tokens one step verified, so speculative and plain
decoding stop at the same token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence


@dataclass(frozen=True)
class StopRules:
    """When a sequence ends: a stop token (once `min_tokens` are out), `max_new_tokens` generated, or `max_seq_len`
    tokens in all (the model's context). Stop strings are matched on text, as it is decoded
    (`hybridspec.runtime.text.SequenceText`)."""

    stop_token_ids: Collection[int]
    max_new_tokens: int | None
    max_seq_len: int
    min_tokens: int = 0


def commit_tokens(tokens: Sequence[int], generated: int, context: int,
                  rules: StopRules) -> tuple[list[int], str | None]:
    """The prefix of `tokens` to commit after `generated` tokens of output and `context` tokens in all, and why the
    sequence ends with it: "eos" (a stop token, kept), "length" (max_new_tokens or the context), or None."""
    kept: list[int] = []
    for token in tokens:
        kept.append(token)
        if token in rules.stop_token_ids and generated + len(kept) > rules.min_tokens:
            return kept, "eos"
        if (rules.max_new_tokens is not None and generated + len(kept) >= rules.max_new_tokens) \
                or context + len(kept) >= rules.max_seq_len:
            return kept, "length"
    return kept, None


def draft_budget(num_speculative_tokens: int, context: int, generated: int, rules: StopRules) -> int:
    """How many draft tokens a step may verify: no more than asked, than fit in the context after the step's input
    token, or than are still wanted (the target's own token comes with every step)."""
    budget = min(num_speculative_tokens, rules.max_seq_len - context)
    if rules.max_new_tokens is not None:
        budget = min(budget, rules.max_new_tokens - generated - 1)
    return max(budget, 0)
