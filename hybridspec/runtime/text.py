"""A sequence's output text, built once as its tokens are committed: decoded incrementally, matched against stop
strings, released to the caller, and parsed for tool calls as it is released. The work per committed token is a
decode of the few tokens since the last complete character, never of the whole output.

Incremental decoding (as vLLM's detokenizer does): a token's text is what decoding the tokens from `prefix` to the
end adds to decoding those from `prefix` to `read`; `prefix..read` are the tokens of the last text released, so a
tokenizer that reads a token differently by what precedes it (a word's leading space) sees that context, and a token
that ends inside a UTF-8 character ("\ufffd" at the end) waits for the rest of its bytes. The text equals decoding all
the tokens at once (`tests/test_text.py` checks it on tokens that split characters and words).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from hybridspec.grammar.tool_calls import Event, ToolCallStreamParser, collect


class IncrementalDetokenizer:
    """The text of a growing list of tokens. `add(token)` returns the text that token completes ("" while a character
    is incomplete); `flush()` the rest at the end (an incomplete character as decoding would show it)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # tokens[_prefix:_read] decode to the end of the text so far

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.tokens):
            return ""
        before = self.decode(self.tokens[self._prefix:self._read])
        after = self.decode(self.tokens[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # no text yet (a special token, or part of a character)
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.tokens)
        self.text += delta
        return delta


class SequenceText:
    """One sequence's output as text: its committed tokens decoded (`IncrementalDetokenizer`), cut before the first
    stop string, and released to the caller in order: while the sequence runs, the last characters that could still be
    the start of a stop string are held back, so that released text is never taken back. With `tools`, what is
    released is parsed for tool calls as it is (`ToolCallStreamParser`): `events` are content and tool-call deltas,
    and `content` / `tool_calls` what they add up to."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), tools: bool = False) -> None:
        self._detokenizer = IncrementalDetokenizer(decode)
        self.stops = tuple(stops)
        self._hold = max(map(len, self.stops), default=1) - 1
        self._stop_at: int | None = None  # where the first stop string begins
        self.stop: str | None = None  # ... and which it is
        self._released = 0
        self._finished = False
        self.parser = ToolCallStreamParser() if tools else None
        self.events: list[Event] = []

    @property
    def text(self) -> str:
        """The output's text so far (before the stop string, once one has been seen)."""
        text = self._detokenizer.text
        return text if self._stop_at is None else text[:self._stop_at]

    def add(self, tokens: Sequence[int]) -> int | None:
        """Decode committed tokens one by one; how many of them it takes for the text to hold a stop string (the
        sequence keeps those and ends), or None."""
        detokenizer = self._detokenizer
        for j, token in enumerate(tokens, start=1):
            start = len(detokenizer.text)
            if detokenizer.add(token) and self.stops and self._stop(start):
                return j
        return None

    def _stop(self, start: int) -> bool:
        """Whether the text holds a stop string now that it grew from `start` characters (one that began earlier
        would have ended the sequence then: only the new text and the `_hold` characters before it are searched)."""
        text = self._detokenizer.text
        lo = max(0, start - self._hold)
        found = [(i, s) for i, s in ((text.find(s, lo), s) for s in self.stops) if i >= 0]
        if found:
            self._stop_at, self.stop = min(found)
        return bool(found)

    def release(self, finished: bool) -> tuple[str, list[Event]]:
        """The text not released before that may be released now (all of it once the sequence has finished), and its
        tool-call events (with tools). Once it has been released finished, nothing more is."""
        if self._finished:
            return "", []
        self._finished = finished
        if finished and self._stop_at is None:
            self._detokenizer.flush()
        text = self.text
        end = len(text) if finished or self._stop_at is not None else max(self._released, len(text) - self._hold)
        delta, self._released = text[self._released:end], end
        if self.parser is None:
            return delta, []
        events = self.parser.feed(delta) if delta else []
        if finished:
            events += self.parser.finish()
        self.events += events
        return delta, events

    def tool_calls(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of the released text, as `parse_tool_calls` gives them for the whole."""
        return collect(self.events)
