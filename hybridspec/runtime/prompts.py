"""Prompts as the engine runs them: text, token ids or chat messages (checked, then rendered by the tokenizer's chat
template)."""
from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

from hybridspec.errors import ContextLengthExceeded, InvalidParameter, InvalidParameterType

Message = Mapping[str, str]
PromptLike = str | Sequence[int] | Sequence[Message]
ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    """Chat messages as plain dicts; an `InvalidParameter` names the first bad one's field ("messages[1].role"; the
    template would otherwise fail on a missing content, or render an unknown role as if it were valid)."""
    if not messages:
        raise InvalidParameter("messages: at least one message is needed", "messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidParameter(f"messages[{i}]: a message is an object with 'role' and 'content', got "
                                   f"{type(m).__name__}", f"messages[{i}]")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InvalidParameter(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}",
                                   f"messages[{i}].role")
        if not isinstance(content, str):
            what = "is missing" if content is None else f"must be a string, got {type(content).__name__}"
            raise InvalidParameter(f"messages[{i}].content {what}", f"messages[{i}].content")
        checked.append({**m, "role": role, "content": content})
    return checked


def is_messages(prompt: Any) -> bool:
    """Chat messages (a list holding any message object; `check_messages` then names whatever else it holds)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and any(isinstance(m, Mapping) for m in prompt)


def encode_prompt(tokenizer: Any, prompt: PromptLike, vocab_size: int, max_seq_len: int) -> list[int]:
    """Token ids of a prompt: text as is, chat messages through the tokenizer's chat template, or token ids. An
    `InvalidParameter` says what is wrong with it (nothing else runs): `param` "prompt", or the chat message's field;
    `ContextLengthExceeded` where it does not fit the context."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif is_messages(prompt):
        ids = tokenizer.apply_chat_template(check_messages(prompt), tokenize=True, add_generation_prompt=True,
                                            return_dict=False)
    elif all(isinstance(t, numbers.Integral) or (getattr(t, "dim", None) is not None and t.dim() == 0)
             for t in prompt):  # token ids: a list, or a 1-d tensor
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameter(f"token id {bad[0]} is out of the vocabulary [0, {vocab_size})", "prompt")
    else:
        raise InvalidParameterType("a prompt is a string, a list of chat messages ({'role', 'content'}) or a list of "
                                   "token ids", "prompt")
    ids = list(ids)
    if not ids:
        raise InvalidParameter("the prompt is empty", "prompt")
    if len(ids) >= max_seq_len:
        raise ContextLengthExceeded(f"the prompt has {len(ids)} tokens; the model's context is {max_seq_len} (at "
                                    f"least one token must remain to generate)", "prompt")
    return ids


def is_batch(prompt_or_prompts: Any) -> bool:
    """A list of prompts (texts or token-id / message lists), not one prompt."""
    if isinstance(prompt_or_prompts, str) or not isinstance(prompt_or_prompts, Sequence):
        return False
    return len(prompt_or_prompts) > 0 and all(
        isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, Mapping)) for p in prompt_or_prompts)
