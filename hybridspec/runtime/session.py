"""`Session`, an agent loop's conversation that keeps its exact tokens turn after turn."""
from __future__ import annotations

from typing import Any, Collection, Mapping, Protocol, Sequence

from hybridspec.runtime.options import SamplingOptions, make_options
from hybridspec.runtime.prompts import Message, check_messages, choose_template
from hybridspec.runtime.stats import GenerationResult, GenerationStats


class Generator(Protocol):
    """What a Session needs of an engine (`Engine` is one): its tokenizer, chat template, stop tokens and `generate`."""

    tokenizer: Any
    chat_template: str | None
    eos_token_ids: Collection[int]

    def generate(self, prompt: list[int], options: SamplingOptions | None = None) -> GenerationResult: ...


class Session:
    """An agent loop's conversation: each `send` appends messages, generates the assistant's reply and keeps it.

    The conversation's exact token ids are kept across turns: a turn appends only the chat template's text that
    follows the previous reply (its end tag, the new messages, the generation prompt), tokenised on its own, so the
    prompt extends the previous turn's prompt + reply token for token: the prefix cache holds its KV (only the new
    tokens run) and the suffix cache continues the previous turn's request (only new tokens are indexed).
    """

    _REPLY = "\x00hybridspec-reply\x00"  # stands for the previous reply when rendering what follows it

    def __init__(self, engine: Generator, system: str | None = None, options: SamplingOptions | None = None,
                 **defaults: Any) -> None:
        self.engine = engine
        self.options = make_options(options, defaults)  # every turn's, unless a turn overrides some
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.tokens: list[int] = []  # the conversation so far, as the model saw and wrote it
        self.stats = GenerationStats()

    def _render(self, messages: list[dict[str, str]], tools: Sequence[Mapping[str, Any]] | None) -> str:
        """The conversation as the engine would render it (`hybridspec.runtime.prompts.render_messages`), as text."""
        tokenizer = self.engine.tokenizer
        template = choose_template(tokenizer, messages, tools, self.engine.chat_template)
        return tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, chat_template=template,
                                             tokenize=False, add_generation_prompt=True)

    def prompt_tokens(self, new_messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
                      ) -> list[int]:
        """The prompt `send(new_messages, tools=tools)` would run: the conversation's tokens + the template's text
        after the previous reply, for the new messages."""
        new_messages = check_messages(new_messages)
        tokenizer = self.engine.tokenizer
        if self.tokens:
            full = self._render(self.messages[:-1] + [{"role": "assistant", "content": self._REPLY}] + new_messages,
                                tools)
            parts = full.split(self._REPLY)
            if len(parts) == 2:
                after = parts[1]
                if self.tokens[-1] in self.engine.eos_token_ids:  # the reply's EOS is the template's end tag
                    end_tag = tokenizer.decode(self.tokens[-1:])
                    after = after[len(end_tag):] if after.startswith(end_tag) else after
                return self.tokens + tokenizer.encode(after, add_special_tokens=False)
        # first turn, or a template that does not render the reply verbatim: tokenise the whole conversation
        return tokenizer.encode(self._render(self.messages + new_messages, tools), add_special_tokens=False)

    def send(self, message: str | Message | Sequence[Message], options: SamplingOptions | None = None,
             **overrides: Any) -> GenerationResult:
        """Add a user message (a string), a message dict (any role, e.g. a tool observation) or several, and reply
        with `options` (default: the session's) and `overrides` over them. With tools the reply's `tool_calls` are
        parsed; the reply stays in the conversation as the model wrote it, calls and all, so the next turn's prompt
        extends it token for token."""
        if isinstance(message, str):
            new = [{"role": "user", "content": message}]
        elif isinstance(message, Mapping):
            new = [dict(message)]
        else:
            new = [dict(m) for m in message]
        new = check_messages(new)
        options = make_options(options, overrides, self.options)
        result = self.engine.generate(self.prompt_tokens(new, options.tools), options)
        # The reply stays in the conversation as the model wrote it (up to the stop string's end, if any).
        self.tokens = result.prompt_token_ids + result.token_ids
        self.messages += new + [{"role": "assistant",
                                 "content": self.engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)}]
        self.stats.add(result.stats)
        return result
