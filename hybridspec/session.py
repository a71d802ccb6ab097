"""Prompts as the engine runs them: text, token ids or chat messages (checked, then rendered by the tokenizer's chat
template), and `Session`, an agent loop's conversation that keeps its exact tokens turn after turn."""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from hybridspec.engine import Engine
    from hybridspec.stats import GenerationResult

Message = Mapping[str, str]
PromptLike = str | Sequence[int] | Sequence[Message]
ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    """Chat messages as plain dicts; a ValueError names the first bad one's field (the template would otherwise fail
    on a missing content, or render an unknown role as if it were valid)."""
    if not messages:
        raise ValueError("messages: at least one message is needed")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: a message is an object with 'role' and 'content', got "
                             f"{type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            what = "is missing" if content is None else f"must be a string, got {type(content).__name__}"
            raise ValueError(f"messages[{i}].content {what}")
        checked.append({**m, "role": role, "content": content})
    return checked


def is_messages(prompt: Any) -> bool:
    """Chat messages (a list holding any message object; `check_messages` then names whatever else it holds)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and any(isinstance(m, Mapping) for m in prompt)


def encode_prompt(tokenizer: Any, prompt: PromptLike, vocab_size: int, max_seq_len: int) -> list[int]:
    """Token ids of a prompt: text as is, chat messages through the tokenizer's chat template, or token ids. A
    ValueError or TypeError says what is wrong with it (nothing else runs)."""
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
            raise ValueError(f"token id {bad[0]} is out of the vocabulary [0, {vocab_size})")
    else:
        raise TypeError("a prompt is a string, a list of chat messages ({'role', 'content'}) or a list of token ids")
    ids = list(ids)
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= max_seq_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {max_seq_len} (at least one token "
                         f"must remain to generate)")
    return ids


def is_batch(prompt_or_prompts: Any) -> bool:
    """A list of prompts (texts or token-id / message lists), not one prompt."""
    if isinstance(prompt_or_prompts, str) or not isinstance(prompt_or_prompts, Sequence):
        return False
    return len(prompt_or_prompts) > 0 and all(
        isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, Mapping)) for p in prompt_or_prompts)


class Session:
    """An agent loop's conversation: each `send` appends messages, generates the assistant's reply and keeps it.

    The conversation's exact token ids are kept across turns: a turn appends only the chat template's text that
    follows the previous reply (its end tag, the new messages, the generation prompt), tokenised on its own, so the
    prompt extends the previous turn's prompt + reply token for token: the prefix cache holds its KV (only the new
    tokens run) and the suffix cache continues the previous turn's request (only new tokens are indexed).
    """

    _REPLY = "\x00hybridspec-reply\x00"  # stands for the previous reply when rendering what follows it

    def __init__(self, engine: "Engine", system: str | None = None, **defaults: Any) -> None:
        from hybridspec.stats import GenerationStats

        self.engine = engine
        self.defaults = dict(defaults)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.tokens: list[int] = []  # the conversation so far, as the model saw and wrote it
        self.stats = GenerationStats()

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_tokens(self, new_messages: Sequence[Message]) -> list[int]:
        """The prompt `send(new_messages)` would run: the conversation's tokens + the template's text after the
        previous reply, for the new messages."""
        new_messages = check_messages(new_messages)
        tokenizer = self.engine.tokenizer
        if self.tokens:
            full = self._render(self.messages[:-1] + [{"role": "assistant", "content": self._REPLY}] + new_messages)
            parts = full.split(self._REPLY)
            if len(parts) == 2:
                after = parts[1]
                if self.tokens[-1] in self.engine.eos_token_ids:  # the reply's EOS is the template's end tag
                    end_tag = tokenizer.decode(self.tokens[-1:])
                    after = after[len(end_tag):] if after.startswith(end_tag) else after
                return self.tokens + tokenizer.encode(after, add_special_tokens=False)
        # first turn, or a template that does not render the reply verbatim: tokenise the whole conversation
        return tokenizer.encode(self._render(self.messages + new_messages), add_special_tokens=False)

    def send(self, message: str | Message | Sequence[Message], **kwargs: Any) -> "GenerationResult":
        """Add a user message (a string), a message dict (any role, e.g. a tool observation) or several, and reply."""
        if isinstance(message, str):
            new = [{"role": "user", "content": message}]
        elif isinstance(message, Mapping):
            new = [dict(message)]
        else:
            new = [dict(m) for m in message]
        new = check_messages(new)
        result = self.engine.generate(self.prompt_tokens(new), **{**self.defaults, **kwargs})
        # The reply stays in the conversation as the model wrote it (up to the stop string's end, if any).
        self.tokens = result.prompt_token_ids + result.token_ids
        self.messages += new + [{"role": "assistant",
                                 "content": self.engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)}]
        self.stats.add(result.stats)
        return result
