"""Tool calls in generated text, Hermes / Qwen style (what our ChatML tools template asks for and our
grammar, `hybridspec.grammar.constraint.tool_calls_tag`, constrains):

    <tool_call>
    {"name": "bash", "arguments": {"command": "ls -la"}}
    </tool_call>

one block per call, possibly after some text. `parse_tool_calls` splits a whole text into its content (the text outside
the blocks) and OpenAI-shaped calls; `ToolCallStreamParser` does the same incrementally, as OpenAI streams them. The
non-streamed parse is the streamed one run on the whole text, so the two always agree.

Rules: a block runs from `<tool_call>` to the first `</tool_call>` outside a JSON string (an argument may hold the tag)
or to the end of the text (a call cut by a stop string or the token limit before its end tag: where only the end
markup is missing, the call's closing `}` included, it is still a call). A block whose body is a JSON object with a
non-empty string "name" and an object "arguments" (or none, or a string holding a JSON object) is a call; any other
block stays content, tags and all, never an error. Content is the text outside the calls, stripped; None if empty.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Iterable

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# A streamed event: a content text delta, or one tool-call delta as OpenAI streams it in `delta.tool_calls`: first
# {"index", "id", "type": "function", "function": {"name", "arguments": ""}}, then {"index", "function":
# {"arguments": fragment}}.
Event = str | dict[str, Any]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole text: the text outside the tool-call blocks, stripped (None if empty), and the
    calls as OpenAI returns them: {"id", "type": "function", "function": {"name", "arguments": a JSON string}}."""
    parser = ToolCallStreamParser(new_id)
    return collect(parser.feed(text) + parser.finish())


def collect(events: Iterable[Event]) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and calls streamed events add up to (what a client reassembles from the deltas)."""
    content, calls = "", []
    for event in events:
        if isinstance(event, str):
            content += event
        elif "id" in event:
            calls.append({"id": event["id"], "type": event["type"], "function": dict(event["function"])})
        else:
            calls[event["index"]]["function"]["arguments"] += event["function"]["arguments"]
    return content or None, calls


class ToolCallStreamParser:
    """Turns text deltas into content deltas and tool-call deltas. Text that may be the start of `<tool_call>` is held
    back until decided, and a call is sent once its block is complete (its JSON known to be a call): streamed calls
    never need taking back, and the events of any split of a text add up to `parse_tool_calls` of the whole."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._buffer = ""  # undecided text: outside a block, a possible start of its tag; inside, the block so far
        self._in_block = False
        self._scanned = 0  # inside a block: how much of it the end-tag search has read, and its JSON string state
        self._in_string = self._escaped = False
        self._started = False  # some content was sent (whitespace before it is dropped)
        self._space = ""  # whitespace after the content sent so far: sent only if more content follows
        self.calls = 0  # calls sent so far

    def feed(self, delta: str) -> list[Event]:
        self._buffer += delta
        events: list[Event] = []
        while True:
            if not self._in_block:
                at = self._buffer.find(TOOL_CALL_BEGIN)
                if at < 0:
                    keep = _partial_tag(self._buffer, TOOL_CALL_BEGIN)
                    self._content(self._buffer[:len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return events
                self._content(self._buffer[:at], events)
                self._buffer = self._buffer[at + len(TOOL_CALL_BEGIN):]
                self._in_block, self._scanned, self._in_string, self._escaped = True, 0, False, False
            else:
                end = self._block_end()
                if end is None:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END):]
                self._in_block = False
                self._block(body, TOOL_CALL_END, events)

    def finish(self) -> list[Event]:
        """The events of the text held back, at the end of the text: an unterminated block is decided as it is."""
        events: list[Event] = []
        if self._in_block:
            self._block(self._buffer, "", events)
        else:
            self._content(self._buffer, events)
        self._buffer, self._in_block = "", False
        return events

    def _block_end(self) -> int | None:
        """Where the block's end tag starts (outside JSON strings), or None while it is not in the buffer yet."""
        text = self._buffer
        i = self._scanned
        while i < len(text):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "<":
                if text.startswith(TOOL_CALL_END, i):
                    return i
                if TOOL_CALL_END.startswith(text[i:]):  # the tag's start at the buffer's end: wait for the rest
                    break
            i += 1
        self._scanned = i
        return None

    def _block(self, body: str, end: str, events: list[Event]) -> None:
        call = _call(body)
        if call is None and not end:  # cut in its end markup (`}\n</tool_call>` in the grammar), or just before it
            whole = body[:len(body) - _partial_tag(body, TOOL_CALL_END)].rstrip()
            call = _call(whole) or _call(whole + "}")
        if call is None:
            self._content(TOOL_CALL_BEGIN + body + end, events)
            return
        name, arguments = call
        index, self.calls = self.calls, self.calls + 1
        events.append({"index": index, "id": self._new_id(), "type": "function",
                       "function": {"name": name, "arguments": ""}})
        events.append({"index": index, "function": {"arguments": arguments}})

    def _content(self, text: str, events: list[Event]) -> None:
        """Send content so that the deltas add up to the whole content stripped."""
        core = text.rstrip()
        if not core:
            if self._started:
                self._space += text
            return
        out = self._space + core if self._started else core.lstrip()
        self._started, self._space = True, text[len(core):]
        if events and isinstance(events[-1], str):
            events[-1] += out
        else:
            events.append(out)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call(body: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of a block's body, or None if it is not a call."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string already
        try:
            if isinstance(json.loads(arguments), dict):
                return data["name"], arguments
        except (ValueError, RecursionError):
            pass
        return None
    if not isinstance(arguments, dict):
        return None
    try:
        return data["name"], json.dumps(arguments, ensure_ascii=False)
    except RecursionError:
        return None
