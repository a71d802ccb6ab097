"""Prompts as the engine runs them: text, token ids or chat messages (checked, then rendered by a chat template: the
tokenizer's own, one given to the engine, or, for tools on a tokenizer whose template ignores them, the shipped ChatML
tools template)."""
from __future__ import annotations

import json
import numbers
import weakref
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from hybridspec.errors import ContextLengthExceeded, InvalidParameter, InvalidParameterType

Message = Mapping[str, Any]
PromptLike = str | Sequence[int] | Sequence[Message]
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's "developer" is the template's "system"
TOOLS_TEMPLATE = "chatml_tools.jinja"  # in hybridspec/grammar/templates/
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def check_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Chat messages as plain dicts; an `InvalidParameter` names the first bad one's field ("messages[1].role"; the
    template would otherwise fail on a missing content, or render an unknown role as if it were valid).

    An assistant message may carry OpenAI's `tool_calls` (its content may then be None or absent: ""); arguments sent
    as a JSON string holding an object are parsed, as vLLM does, so that templates that render them as JSON do not
    quote them. In a conversation with tool calls, each `tool` message needs the `tool_call_id` it answers (elsewhere
    a tool message is a plain observation, as a text-based agent sends it)."""
    if not messages:
        raise InvalidParameter("messages: at least one message is needed", "messages")
    calling = any(isinstance(m, Mapping) and m.get("tool_calls") for m in messages)
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidParameter(f"messages[{i}]: a message is an object with 'role' and 'content', got "
                                   f"{type(m).__name__}", f"messages[{i}]")
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in ROLES:
            raise InvalidParameter(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}",
                                   f"messages[{i}].role")
        message = dict(m)
        if calls is not None:
            if role != "assistant":
                raise InvalidParameter(f"messages[{i}].tool_calls: only assistant messages call tools",
                                       f"messages[{i}].tool_calls")
            message["tool_calls"] = _check_tool_calls(calls, f"messages[{i}].tool_calls")
            if content is None and message["tool_calls"]:
                content = ""
        if not isinstance(content, str):
            what = "is missing" if content is None else f"must be a string, got {type(content).__name__}"
            raise InvalidParameter(f"messages[{i}].content {what}", f"messages[{i}].content")
        call_id = m.get("tool_call_id")
        if role == "tool" and (call_id is not None or calling) and (not isinstance(call_id, str) or not call_id):
            raise InvalidParameter(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                                   f"messages[{i}].tool_call_id")
        checked.append({**message, "role": "system" if role == "developer" else role, "content": content})
    return checked


def _check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise InvalidParameter(f"{where} must be a list of tool calls", where)
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise InvalidParameter(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                                   f"{where}[{j}]")
        name, arguments = function.get("name"), function.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise InvalidParameter(f"{where}[{j}].function.name must be a non-empty string",
                                   f"{where}[{j}].function.name")
        if isinstance(arguments, str):  # kept as sent where it is not a JSON object
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        elif not isinstance(arguments, Mapping):
            raise InvalidParameter(f"{where}[{j}].function.arguments must be a JSON object or a string",
                                   f"{where}[{j}].function.arguments")
        else:
            arguments = dict(arguments)
        checked.append({**call, "type": "function", "function": {**function, "name": name, "arguments": arguments}})
    return checked


def is_messages(prompt: Any) -> bool:
    """Chat messages (a list holding any message object; `check_messages` then names whatever else it holds)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and any(isinstance(m, Mapping) for m in prompt)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters any one token's text holds: a prompt of n characters has at least n / this many tokens.
    The vocabulary's own strings (byte-level BPE's spell a byte as one character, a UTF-8 character's bytes as
    several) are never shorter than the text they decode to."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(t) for t in vocab), default=0) or 64


def prompt_chars(prompt: Any) -> int:
    """The characters of a prompt's text (a chat prompt's message contents, whatever their shape); 0 for token ids."""
    if isinstance(prompt, str):
        return len(prompt)
    if not is_messages(prompt):
        return 0
    total, todo = 0, [m.get("content") for m in prompt if isinstance(m, Mapping)]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            todo.extend(item.values())
        elif isinstance(item, Sequence) and not isinstance(item, (bytes, bytearray)):
            todo.extend(item)
    return total


def encode_prompt(tokenizer: Any, prompt: PromptLike, vocab_size: int, max_seq_len: int,
                  tools: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                  token_chars: int | None = None) -> list[int]:
    """Token ids of a prompt: text as is, chat messages through a chat template, or token ids. A chat prompt is
    rendered with `tools` (OpenAI function tools) by `chat_template` (a template's text), by default the
    tokenizer's own, or the shipped ChatML tools template where that one ignores tools. An `InvalidParameter` says
    what is wrong with the prompt (nothing else runs): `param` "prompt", or the chat message's field;
    `ContextLengthExceeded` where it does not fit the context, before tokenizing where its text alone is longer than
    the context's tokens of `token_chars` characters each (`longest_token_chars`) could hold."""
    if token_chars is not None and (chars := prompt_chars(prompt)) > token_chars * max_seq_len:
        raise ContextLengthExceeded(f"the prompt has {chars} characters, at least {chars // token_chars} tokens; the "
                                    f"model's context is {max_seq_len}", "prompt")
    if isinstance(prompt, (list, tuple)) and not is_messages(prompt) and len(prompt) >= max_seq_len:  # before each id
        raise ContextLengthExceeded(f"the prompt has {len(prompt)} tokens; the model's context is {max_seq_len} (at "
                                    f"least one token must remain to generate)", "prompt")
    if isinstance(prompt, str):
        _check_unicode(prompt, "prompt")
        ids = tokenizer.encode(prompt)
    elif is_messages(prompt):
        messages = check_messages(prompt)
        for i, message in enumerate(messages):
            _check_unicode(message.get("content"), f"messages[{i}].content")
        if tools and not valid_unicode(json.dumps(tools, ensure_ascii=False, default=str)):
            raise InvalidParameter("tools hold text that is not valid Unicode (a lone surrogate)", "tools")
        ids = render_messages(tokenizer, messages, tools, chat_template)
    elif hasattr(prompt, "__iter__") and all(
            isinstance(t, numbers.Integral) or (getattr(t, "dim", None) is not None and t.dim() == 0)
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


def valid_unicode(text: str) -> bool:
    """False where text holds a lone surrogate ("\\ud800": valid in JSON, taken by no tokenizer)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_unicode(content: Any, param: str) -> None:
    """An `InvalidParameter` naming `param` where a content's text is not valid Unicode."""
    texts = [content] if isinstance(content, str) else [
        p.get("text") for p in content or [] if isinstance(p, Mapping)] if isinstance(content, list) else []
    if any(isinstance(text, str) and not valid_unicode(text) for text in texts):
        raise InvalidParameter(f"{param} holds text that is not valid Unicode (a lone surrogate)", param)


def is_batch(prompt_or_prompts: Any) -> bool:
    """A list of prompts (texts or token-id / message lists), not one prompt."""
    if isinstance(prompt_or_prompts, str) or not isinstance(prompt_or_prompts, Sequence):
        return False
    return len(prompt_or_prompts) > 0 and all(
        isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, Mapping)) for p in prompt_or_prompts)


def render_messages(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template: str | None = None) -> list[int]:
    """Token ids of checked chat messages (`encode_prompt`'s choice of template); a template that refuses them (its
    `raise_exception`, e.g. roles out of turn) is an `InvalidParameter` on "messages"."""
    from jinja2 import TemplateError

    tools = list(tools) if tools else None
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                             chat_template=choose_template(tokenizer, messages, tools, chat_template),
                                             return_dict=False)
    except TemplateError as e:
        raise InvalidParameter(f"messages: the chat template cannot render them: {e}", "messages") from None


def choose_template(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None) -> str | None:
    """The template that renders `messages` (None: the tokenizer's own): `chat_template` where given, else the
    shipped tools template where tools or tool calls are to be rendered and the tokenizer's own ignores tools."""
    if chat_template is None and (tools or any(m.get("tool_calls") for m in messages)) and ignores_tools(tokenizer):
        return tools_template()
    return chat_template


_ignores_tools: "weakref.WeakKeyDictionary[Any, tuple[Any, bool]]" = weakref.WeakKeyDictionary()


def ignores_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a conversation the same with tools as without (SmolLM2's plain
    ChatML): then tools would silently vanish from the prompt. Checked once per tokenizer and template."""
    cached = _ignores_tools.get(tokenizer)
    if cached is None or cached[0] != tokenizer.chat_template:
        probe = [{"role": "user", "content": "probe"}]
        renders = [tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, add_generation_prompt=True)
                   for tools in (None, [_PROBE_TOOL])]
        cached = _ignores_tools[tokenizer] = (tokenizer.chat_template, renders[0] == renders[1])
    return cached[1]


@lru_cache(maxsize=None)
def tools_template() -> str:
    """The shipped ChatML template with Hermes-style tool calls (package data of hybridspec.grammar)."""
    return resources.files("hybridspec.grammar").joinpath("templates", TOOLS_TEMPLATE).read_text(encoding="utf-8")


def load_chat_template(path_or_text: str | Path) -> str:
    """A chat template given as a file's path or as the template itself (as vLLM's --chat-template takes it)."""
    path = Path(path_or_text)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a template's text can be too long to be a file name
        pass
    text = str(path_or_text)
    if "{{" in text or "{%" in text:
        return text
    raise ValueError(f"chat template {text!r}: no such file, and not a Jinja template")
