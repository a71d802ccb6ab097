"""Grammars for structured output and tool calls, and one sequence's grammar state as the decode step uses it.

Why xgrammar: it is the structured-output backend vLLM and SGLang default to, compiles JSON schemas and the tool-call
formats of current models (its structural tags: free text until `<tool_call>`, then the called function's schema) in
milliseconds, fills a next-token mask in ~10 us on a CPU, and rolls its matcher back by tokens, which is what checking
a draft and then keeping only its accepted part needs.

Speculation under a grammar stays exact because the target's distribution at every verified position is the masked one
(the mask at the state after that position's draft prefix), which is what plain constrained decoding samples from:
a draft is cut at its first token the grammar rejects (a deterministic draft: the cut is a function of the history; a
sampled one is redrawn from the drafter's masked distribution instead, `Constraint.redraw`), and the tokens the grammar
forces are drafted after it (`Constraint.check`).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from hybridspec.errors import InvalidParameter
from hybridspec.proposal import Proposal

# The Hermes tool-call format (Qwen2.5/3, Hermes, our ChatML tools template): <tool_call>\n{"name": "...",
# "arguments": {...}}\n</tool_call>, calls one per line
TOOL_CALL_BEGIN, TOOL_CALL_END = '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>"
TOOL_CHOICES = ("auto", "none", "required")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # also what keeps a name from breaking out of the call's JSON


@dataclass(frozen=True)
class GrammarSpec:
    """What a call's output must match. kind: "json_schema" (`body`: the schema; a JSON object for json_object) or
    "tools" (`body`: the tools, tool_choice and parallel_tool_calls); `body` is JSON in the caller's property order,
    which the grammar keeps. compact: the JSON has no free whitespace (`", "` and `": "` between its parts, as
    `json.dumps` writes it; vLLM's `disable-any-whitespace`); False allows any whitespace between its tokens."""

    kind: str
    body: str
    compact: bool = True


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict], str | dict]:
    """`tools` as OpenAI function tools and `tool_choice` ("auto" where tools are given and it is None); an
    `InvalidParameter` names the bad field."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidParameter("tool_choice needs tools", "tool_choice")
        return [], "none"
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidParameter("tools must be a list of function tools", "tools")
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(
                function, Mapping):
            raise InvalidParameter(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                   f"tools[{i}]")
        name, parameters = function.get("name"), function.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidParameter(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-' (OpenAI's "
                                   f"rule), got {name!r}", f"tools[{i}].function.name")
        if not isinstance(parameters, Mapping):
            raise InvalidParameter(f"tools[{i}].function.parameters must be a JSON schema object",
                                   f"tools[{i}].function.parameters")
        checked.append({"type": "function", "function": {**function, "parameters": dict(parameters)}})
    names = [t["function"]["name"] for t in checked]
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in names:
            raise InvalidParameter(f"tool_choice names {name!r}, which is not one of the tools ({', '.join(names)})",
                                   "tool_choice")
        tool_choice = {"type": "function", "function": {"name": name}}
    elif tool_choice not in TOOL_CHOICES:
        raise InvalidParameter(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, got "
                               f"{tool_choice!r}", "tool_choice")
    if tool_choice == "required" and not checked:
        raise InvalidParameter("tool_choice 'required' needs at least one tool", "tool_choice")
    return checked, tool_choice


def grammar_spec(response_format: Mapping[str, Any] | None = None, tools: Sequence[Mapping] | None = None,
                 tool_choice: str | Mapping | None = None, parallel_tool_calls: bool = True,
                 compact: bool = True) -> GrammarSpec | None:
    """The grammar a call's options ask for, or None. An `InvalidParameter` names a bad field."""
    return checked_grammar_spec(response_format, *check_tools(tools, tool_choice), parallel_tool_calls, compact)


def checked_grammar_spec(response_format: Mapping[str, Any] | None, tools: list[dict], tool_choice: str | dict,
                         parallel_tool_calls: bool, compact: bool = True) -> GrammarSpec | None:
    """`grammar_spec` of tools and a tool_choice `check_tools` has checked already."""
    kind = "text"
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise InvalidParameter("response_format must be an object with a 'type'", "response_format")
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidParameter(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                                   "response_format.type")
    if kind != "text" and tool_choice != "none":
        raise InvalidParameter("response_format cannot be combined with tools unless tool_choice is 'none'",
                               "response_format")
    if tool_choice != "none":
        body = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": bool(parallel_tool_calls)}
        return GrammarSpec("tools", json.dumps(body), compact)
    if kind == "json_object":
        return GrammarSpec("json_schema", json.dumps({"type": "object"}), compact)
    if kind == "json_schema":  # enforced whether or not `strict` is set, as vLLM does
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidParameter("response_format.json_schema.schema must be a JSON schema object",
                                   "response_format.json_schema")
        return GrammarSpec("json_schema", json.dumps(schema), compact)
    return None


def tool_calls_tag(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool, compact: bool = True) -> Any:
    """xgrammar's structural tag for Hermes tool calls: "auto" is free text in which a call, once begun, follows its
    function's schema (compact: as `json.dumps` writes it); "required" and a named function are calls only (one per
    line), then the end."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (GrammarFormat, JSONSchemaFormat, StructuralTag, TagFormat,
                                         TagsWithSeparatorFormat, TriggeredTagsFormat)

    def arguments(schema: dict) -> Any:
        if not compact:
            return JSONSchemaFormat(json_schema=schema)
        return GrammarFormat(grammar=str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)))

    if isinstance(tool_choice, Mapping):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    tags = [TagFormat(begin=TOOL_CALL_BEGIN.replace("{name}", t["function"]["name"]),
                      content=arguments(t["function"]["parameters"]), end=TOOL_CALL_END)
            for t in tools]
    if tool_choice == "auto":
        return StructuralTag(format=TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags,
                                                        stop_after_first=not parallel_tool_calls))
    return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                                        stop_after_first=not parallel_tool_calls))


MAX_SCHEMA_BYTES = 128 << 10  # an 8,000-value enum (100 KB) compiles in 0.1 s here, a 10,000-value one (129 KB) in 4 s
COMPILE_TIMEOUT_S = 10.0
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:\d+: ")


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer and makes each sequence its `Constraint`. stop_token_ids: the tokens
    that end generation, allowed once the grammar is complete.

    What a request may cost is bounded: schemas past `max_schema_bytes` (their JSON; a tool's description does not
    count) are refused before compiling, and a compile that runs past `timeout_s` is answered with an
    `InvalidParameter` while it finishes in the background. Compiles run in threads of their own (xgrammar releases
    the GIL), each spec once: the same schema again, even while it compiles, waits for that compile (the last
    `cache_size` specs are kept)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_schema_bytes: int = MAX_SCHEMA_BYTES, timeout_s: float = COMPILE_TIMEOUT_S,
                 cache_size: int = 64) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.max_schema_bytes, self.timeout_s, self.cache_size = max_schema_bytes, timeout_s, cache_size
        self._compiler = None
        self._lock = threading.Lock()
        self._compiles: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hybridspec-grammar")

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; an `InvalidParameter` (param "tools" or "response_format") where the schema is too
        large, takes too long, cannot be compiled or can never be satisfied."""
        param = "tools" if spec.kind == "tools" else "response_format"
        size = schema_bytes(spec)
        if size > self.max_schema_bytes:
            raise InvalidParameter(f"{param}: the schema is {size} bytes of JSON; this server compiles at most "
                                   f"{self.max_schema_bytes}", param)
        with self._lock:
            future = self._compiles.get(spec)
            if future is None or (future.done() and _unexpected(future.exception())):  # a fault: try again
                future = self._compiles[spec] = self._pool.submit(self._compile, spec, param)
                while len(self._compiles) > self.cache_size:
                    self._compiles.popitem(last=False)
            self._compiles.move_to_end(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except InvalidParameter as e:  # the same refusal as the first time, raised afresh (a traceback of its own)
            raise InvalidParameter(str(e), e.param) from None
        except TimeoutError:
            raise InvalidParameter(f"{param}: the schema takes more than {self.timeout_s:g} s to compile (a large "
                                   f"enum or a deeply nested schema)", param) from None

    def _compile(self, spec: GrammarSpec, param: str) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            if spec.kind == "json_schema":
                compiled = self._compiler.compile_json_schema(spec.body, any_whitespace=not spec.compact)
            else:
                compiled = self._compiler.compile_structural_tag(
                    tool_calls_tag(**json.loads(spec.body), compact=spec.compact))
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for a bad schema subclass these
            raise InvalidParameter(f"{param}: the schema cannot be compiled: {compiler_reason(e)}", param) from None
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        if not bool(mask.any()):
            raise InvalidParameter(f"{param}: no output can satisfy the schema (a $ref that only refers to itself?)",
                                   param)
        return compiled

    def constraint(self, compiled: Any, param: str = "response_format") -> "Constraint":
        """A sequence's state in `compiled`; `param`: what its errors name ("tools" or "response_format")."""
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(compiled), self.vocab_size, self._encode, param)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _unexpected(error: BaseException | None) -> bool:
    return error is not None and not isinstance(error, InvalidParameter)


def schema_bytes(spec: GrammarSpec) -> int:
    """The size of what the grammar is compiled from: the schema, or the tools' parameter schemas."""
    if spec.kind != "tools":
        return len(spec.body)
    tools = json.loads(spec.body)["tools"]
    return sum(len(json.dumps(t["function"].get("parameters") or {})) for t in tools)


def compiler_reason(e: Exception) -> str:
    """xgrammar's error in a sentence a client can act on: its message without the C++ source location, or where
    it reports an internal check, what that means."""
    text = _CPP_PREFIX.sub("", str(e).strip()).strip()
    if not text or "Check failed" in text or "\n" in text:
        return "it uses a construct the grammar compiler does not support (e.g. a pattern it cannot convert)"
    return text


class Constraint:
    """One sequence's grammar state (an xgrammar matcher at its committed tokens). Every method leaves the matcher
    where it found it but `accept`."""

    def __init__(self, matcher: Any, vocab_size: int, encode: Callable[[str], list[int]],
                 param: str = "response_format") -> None:
        import xgrammar as xgr

        self.matcher, self.vocab_size, self.encode, self.param = matcher, vocab_size, encode, param
        self._scratch = xgr.allocate_token_bitmask(1, vocab_size)

    def _check_alive(self, mask: torch.Tensor, filled: bool) -> None:
        """An `InvalidParameter` where the grammar allows no token after the committed ones (not even the end): a
        schema that cannot be completed, found only as the output reaches that point."""
        if filled and not self.matcher.is_terminated() and not bool(mask.any()):
            raise InvalidParameter(f"{self.param}: the output reached a point where the schema allows nothing more "
                                   f"(a schema that can never be satisfied)", self.param)

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance past committed tokens (the target chose them from masked distributions). The mask can still allow
        a token the matcher then rejects: where the schema wants characters no token of the vocabulary writes (a
        pattern of one such character), xgrammar's mask lets the tokenizer's unknown token through; that request's
        schema cannot be satisfied by this model, a client's error."""
        for token in tokens:
            if not self.matcher.accept_token(int(token)):
                raise InvalidParameter(f"{self.param}: the output reached a point where the schema allows only "
                                       f"characters this model's vocabulary cannot write", self.param)

    def redraw(self, proposal: Proposal, probs_fn: Callable[[torch.Tensor], torch.Tensor],
               generator: torch.Generator | None, keep_allowed: bool) -> Proposal:
        """A sampled chain drawn again from the drafter's grammar-masked distributions q'_j = probs_fn(masked logits),
        which the verifier then uses as the draft distribution. keep_allowed (no top-k / top-p: q'_j is q_j
        renormalised over the allowed tokens): a drafted token the grammar allows is kept, as a draw of q_j given that
        it landed in the allowed set is a draw of q'_j; a rejected one is replaced by a fresh draw. Stops where q'_j
        has no mass. Cutting at a rejected token instead would skew the sample towards the drafts the grammar allows."""
        logits = proposal.draft_logits.float().clone()
        tokens: list[int] = []
        for j, token in enumerate(proposal.token_ids):
            self.matcher.fill_next_token_bitmask(self._scratch)
            row = logits[j:j + 1]
            apply_mask(row, self._scratch)
            q = probs_fn(row)[0]
            total = float(q.sum())
            if not total > 0:
                break
            if not (keep_allowed and _allowed(self._scratch[0], token)):
                token = int(torch.multinomial(q / total, 1, generator=generator))
            if not self.matcher.accept_token(token):
                break
            tokens.append(token)
        self.matcher.rollback(len(tokens))
        n = len(tokens)
        probs = proposal.probs[:n] if proposal.probs else None
        return Proposal.chain(tokens, probs, source=proposal.source, match_len=proposal.match_len,
                              draft_logits=logits[:n]) if n else Proposal.empty(proposal.source)

    def prepare(self, proposal: Proposal, budget: int, forced: bool) -> "GrammarDraft":
        """A draft under the grammar, in one walk with the matcher: the part the grammar allows (a chain cut at its
        first rejected token; a tree without the subtrees of rejected nodes), a chain then extended with the tokens
        the grammar forces after it (`forced`), to at most `budget` nodes, and the masks of a verification pass
        over the result."""
        if not proposal.is_chain:
            return self._prepare_tree(proposal)
        import xgrammar as xgr

        matcher = self.matcher
        masks = xgr.allocate_token_bitmask(1 + max(budget, len(proposal)), self.vocab_size)
        needed = False

        def fill(row: int) -> None:
            nonlocal needed
            if not matcher.is_terminated():  # after a drafted stop token nothing more is committed
                needed |= matcher.fill_next_token_bitmask(masks, row)

        fill(0)
        self._check_alive(masks[0], needed)
        kept = 0
        for token in proposal.token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            kept += 1
            fill(kept)
        extra: list[int] = []
        if forced and kept < budget and not matcher.is_terminated():
            text = matcher.find_jump_forward_string()
            for token in self.encode(text) if text else []:
                if kept + len(extra) >= budget or not matcher.accept_token(token):
                    break
                extra.append(token)
                fill(kept + len(extra))
            while kept + len(extra) < budget and not matcher.is_terminated():
                token = _only_allowed(masks[kept + len(extra)])  # the row this state just filled
                if token is None or not matcher.accept_token(token):
                    break
                extra.append(token)
                fill(kept + len(extra))
        matcher.rollback(kept + len(extra))
        draft = proposal.subset(list(range(kept)))
        if extra:
            last = draft.probs[-1] if draft.probs else 1.0
            probs = list(draft.probs or [1.0] * kept) + [last] * len(extra)
            chain = Proposal.chain(draft.token_ids + extra, probs, source=draft.source if kept else "grammar",
                                   match_len=draft.match_len)
            chain.drafter_ran, draft = draft.drafter_ran, chain
        return GrammarDraft(draft, len(extra), masks[:1 + len(draft)] if needed else None)

    def _prepare_tree(self, proposal: Proposal) -> "GrammarDraft":
        """`prepare` of a tree: depth-first through it with the matcher, each state's mask filled once (row 0: the
        committed tokens, 1 + i: after node i), the nodes the grammar allows kept with their ancestors."""
        import xgrammar as xgr

        masks = xgr.allocate_token_bitmask(1 + len(proposal), self.vocab_size)
        children: list[list[int]] = [[] for _ in range(len(proposal) + 1)]
        for i, parent in enumerate(proposal.parents):
            children[parent + 1].append(i)
        kept: list[int] = []
        needed = False

        def visit(row: int) -> None:
            nonlocal needed
            if self.matcher.is_terminated():  # a drafted stop token: nothing follows it
                return
            needed |= self.matcher.fill_next_token_bitmask(masks, row)
            for i in children[row]:
                if self.matcher.accept_token(proposal.token_ids[i]):
                    kept.append(i)
                    visit(1 + i)
                    self.matcher.rollback(1)

        visit(0)
        self._check_alive(masks[0], needed)
        kept.sort()
        rows = torch.tensor([0] + [1 + i for i in kept])
        return GrammarDraft(proposal.subset(kept), 0, masks[rows] if needed else None)


@dataclass
class GrammarDraft:
    """One row's draft under its grammar (`Constraint.prepare`): the draft, how many of its last tokens the grammar
    forced, and the masks of a verification pass over it, [1 + n, vocab / 32] int32 bits (row 0 at the committed
    tokens, row 1 + i after the path to node i; None where every token is allowed at every position)."""

    proposal: Proposal
    forced: int = 0
    masks: torch.Tensor | None = None

    def routed(self, keep: Sequence[int]) -> torch.Tensor | None:
        """The masks of the draft as routed (its nodes `keep`)."""
        if self.masks is None or len(keep) == len(self.proposal):
            return self.masks
        return self.masks[torch.tensor([0] + [1 + i for i in keep])]


def apply_mask(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """logits [m, V] (float32) set to -inf where masks [>= m, V / 32] has a 0 bit, in place."""
    import xgrammar as xgr

    rows = logits.shape[0]
    if logits.is_contiguous() and logits.dtype == torch.float32:
        xgr.apply_token_bitmask_inplace(logits, masks[:rows], vocab_size=logits.shape[1])
        return
    bits = (masks[:rows, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    logits.masked_fill_(bits.view(rows, -1)[:, :logits.shape[1]] == 0, float("-inf"))


def _allowed(mask_row: torch.Tensor, token: int) -> bool:
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


def _only_allowed(mask_row: torch.Tensor) -> int | None:
    """The one token a mask row allows, or None where it allows several (or none)."""
    words = mask_row.nonzero()
    if len(words) != 1:
        return None
    index = int(words[0])
    word = int(mask_row[index]) & 0xFFFFFFFF
    return index * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None
