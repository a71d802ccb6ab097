"""Token ids of replayed calls: the target's tokenizer and chat template, message by message, cached on disk.

Why message by message: an agent re-sends its whole conversation with every call, so call i+1's prompt should be
call i's prompt + response + the new messages *as tokens*; the suffix cache's session API
(`start_request(rid, prompt, extends=prev_rid)`) then indexes only the new tokens. Tokenising each rendered prompt
whole does not guarantee that (BPE merges can cross the boundary where the response ends). So the chat template is
split into text pieces - the text before the first message's content, the separators between two messages' contents
(footer of one + header of the next), and the tail after the last one (footer + generation prompt) - by rendering
probe conversations with sentinel contents. Each piece and each message content is tokenised on its own and the ids
are concatenated. Every call's pieces are checked against the template's own rendering of that call; a call whose
template is not separable this way (e.g. one that rewrites earlier turns) is tokenised whole instead. The pieces'
ids differ from the whole rendering's only where a BPE merge would cross a cut (e.g. a content that starts with
spaces, after the header's newline); with SmolLM2 on the development traces they agree on every prompt.
A response is its content's tokens plus the end-of-turn token the model emits (`<|im_end|>` for ChatML), which is
also how it appears inside the next prompt. Plain-text prompts (generic JSONL "prompt": "...") are tokenised in
pieces too: the previous call's prompt and response when the text starts with them, then the rest.

Each message content is tokenised once per replay (agent prompts repeat the same messages call after call), all
unique texts in one batch. The result is cached per source file, keyed by the file's content hash and the tokenizer
files' hash, so a second replay of the same files loads token ids without loading the tokenizer.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridspec.agent_traces.formats import Call, Message, TraceSource

log = logging.getLogger(__name__)

# Bump when the tokenisation scheme changes, so stale cache entries are not reused.
CACHE_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
_ENCODE_CHUNK = 256


@dataclass(slots=True)
class TokenizedCall:
    prompt: np.ndarray    # int32 token ids of the rendered prompt, generation prompt included
    response: np.ndarray  # int32 token ids of the logged response + end-of-turn token


@dataclass(slots=True)
class TokenizedTrajectory:
    framework: str
    session_id: str
    calls: list[TokenizedCall]


def tokenizer_dir(name_or_path: str | os.PathLike = "smollm2") -> Path:
    """A local directory holding the tokenizer: an existing directory as given, else a model name for
    `hybridspec.model.loading.resolve_model` (default: the embedded SmolLM2)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise FileNotFoundError(f"{path} holds no Hugging Face tokenizer files ({', '.join(_TOKENIZER_FILES[:2])})")
        return path
    return _models(f"resolving the model name {str(name_or_path)!r}").resolve_model(name_or_path)


def _models(why: str):
    """hybridspec.model.loading, which needs torch (absent from e.g. the peers' benchmark environment)."""
    try:
        import hybridspec.model.loading as models
    except ImportError as e:
        raise ImportError(f"{why} needs hybridspec.model.loading, which cannot be imported here ({e}); "
                          "pass a tokenizer directory and a cache directory instead") from e
    return models


def tokenizer_fingerprint(directory: Path) -> str:
    """Hash of the tokenizer's files (vocabulary, merges, special tokens, chat template)."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = directory / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class ChatPieces:
    """Splits a Hugging Face chat template into the text pieces around message contents (see the module doc)."""

    _SENTINELS = ("\u2063hybridspec-probe-0\u2063", "\u2063hybridspec-probe-1\u2063")

    def __init__(self, render: Callable[[list[Message], bool], str]):
        self._render = render
        self._memo: dict[tuple, str | None] = {}

    def _probe(self, roles: tuple[str, ...], generation_prompt: bool) -> list[str] | None:
        """The text around the sentinel contents of a probe conversation, or None if the template does not keep them."""
        msgs = [{"role": r, "content": s} for r, s in zip(roles, self._SENTINELS)]
        try:
            text = self._render(msgs, generation_prompt)
        except Exception:  # a template may reject a role order ("roles must alternate"): fall back to whole renders
            return None
        parts = []
        for s in self._SENTINELS[: len(roles)]:
            before, found, text = text.partition(s)
            if not found:
                return None
            parts.append(before)
        return parts + [text]

    def _piece(self, kind: str, *roles: str) -> str | None:
        """The text before the first content (kind "head"), between two contents ("sep") or after the last one,
        generation prompt included ("tail"), for these roles; None if the template does not keep the probe contents."""
        key = (kind, *roles)
        if key not in self._memo:
            parts = self._probe(roles, generation_prompt=kind == "tail")
            self._memo[key] = None if parts is None else parts[0 if kind == "head" else 1]
        return self._memo[key]

    def pieces(self, messages: Sequence[Message]) -> list[str] | None:
        """[head, content_0, sep_01, content_1, ..., content_n-1, tail], or None when the template is not separable
        for these messages (the caller then tokenises the whole rendering)."""
        if not messages:
            return None
        out = [self._piece("head", messages[0]["role"])]
        for prev, msg in zip(messages, messages[1:]):
            out += [prev["content"], self._piece("sep", prev["role"], msg["role"])]
        out += [messages[-1]["content"], self._piece("tail", messages[-1]["role"])]
        if any(p is None for p in out):
            return None
        if "".join(out) != self._render(list(messages), True):
            return None
        return out

    def assistant_footer(self) -> str:
        """The template's text after an assistant message's content (e.g. "<|im_end|>\\n")."""
        parts = self._probe(("user", "assistant"), False)
        return parts[2] if parts else ""


class _PieceTable:
    """Unique texts of the sources being tokenised, each encoded once; pieces given as token ids are kept as is."""

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.texts: list[str | None] = []
        self.tokens: list[np.ndarray | None] = []

    def text(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.texts)
            self.texts.append(s)
            self.tokens.append(None)
        return i

    def fixed(self, key: str, token_ids: Sequence[int]) -> int:
        i = self.ids.get((key,))
        if i is None:
            i = self.ids[(key,)] = len(self.texts)
            self.texts.append(None)
            self.tokens.append(np.asarray(token_ids, dtype=np.int32))
        return i

    def encode(self, encode_batch: Callable[[list[str]], list[list[int]]], progress: bool | None) -> None:
        from tqdm.auto import tqdm

        todo = [i for i, t in enumerate(self.tokens) if t is None]
        # long texts first keeps the batches balanced across the tokenizer's threads
        todo.sort(key=lambda i: -len(self.texts[i]))
        with tqdm(total=sum(len(self.texts[i]) for i in todo), unit="char", unit_scale=True, desc="tokenising",
                  disable=None if progress is None else not progress) as bar:
            for start in range(0, len(todo), _ENCODE_CHUNK):
                chunk = todo[start : start + _ENCODE_CHUNK]
                for i, ids in zip(chunk, encode_batch([self.texts[i] for i in chunk])):
                    self.tokens[i] = np.asarray(ids, dtype=np.int32)
                bar.update(sum(len(self.texts[i]) for i in chunk))


@dataclass(slots=True)
class _SourcePlan:
    """A source's calls as piece ids (into a _PieceTable), before the pieces are encoded."""

    prompt_pieces: list[list[int]]
    response_pieces: list[list[int]]
    calls_per_trajectory: list[int]


def _gather(tokens: np.ndarray, offsets: np.ndarray, piece_ids: np.ndarray) -> np.ndarray:
    """Concatenation of the pieces' token ids, without a Python loop over pieces."""
    starts, ends = offsets[piece_ids], offsets[piece_ids + 1]
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int32)
    # index of every output token: a run per piece from its start, built by a cumulative sum of steps
    steps = np.ones(total, dtype=np.int64)
    nonempty = lengths > 0
    run_starts = np.concatenate(([0], np.cumsum(lengths[nonempty])[:-1]))
    s = starts[nonempty]
    steps[run_starts] = s - np.concatenate(([0], s[:-1] + lengths[nonempty][:-1] - 1))
    return tokens[np.cumsum(steps)]


class TraceTokenizer:
    """Turns loaded trace sources into token ids with a target's tokenizer and chat template (see the module doc).

    `tokenizer`: a local Hugging Face tokenizer (or model) directory, or a model name for `hybridspec.model.loading`
    (default "smollm2", the embedded SmolLM2-135M-Instruct). The tokenizer itself is loaded only on a cache miss.
    """

    def __init__(self, tokenizer: str | os.PathLike = "smollm2", cache_dir: str | os.PathLike | None = None,
                 use_cache: bool = True):
        self.directory = tokenizer_dir(tokenizer)
        self.fingerprint = tokenizer_fingerprint(self.directory)
        if cache_dir is None:
            cache_dir = _models("the default cache directory").cache_dir() / "agent_traces"
        self.cache_dir = Path(cache_dir)
        self.use_cache = use_cache
        self.stats = {"cache_hits": 0, "cache_misses": 0, "tokenized_chars": 0, "whole_prompt_calls": 0}
        self._hf = None
        self._pieces: ChatPieces | None = None
        self._eot: list[int] = []

    # ------------------------------------------------------------------------------------------------ public

    def tokenize(self, sources: Sequence[TraceSource], progress: bool | None = None) -> list[TokenizedTrajectory]:
        """Token ids of every trajectory of `sources`, in order; cached sources are read from disk."""
        arrays: dict[int, dict[str, np.ndarray]] = {}
        missing = []
        for n, src in enumerate(sources):
            cached = self._read_cache(src) if self.use_cache else None
            if cached is not None:
                arrays[n] = cached
                self.stats["cache_hits"] += 1
            else:
                missing.append(n)
                self.stats["cache_misses"] += 1
        if missing:
            table = _PieceTable()
            plans = {n: self._plan(sources[n], table) for n in missing}
            self.stats["tokenized_chars"] += sum(len(t) for t, tok in zip(table.texts, table.tokens) if tok is None)
            table.encode(self._encode_batch, progress)
            for n, plan in plans.items():
                arrays[n] = self._pack(plan, table)
                if self.use_cache:
                    self._write_cache(sources[n], arrays[n])
        return [t for n, src in enumerate(sources) for t in self._unpack(src, arrays[n])]

    # ------------------------------------------------------------------------------------------------ tokenizer

    def _load_hf(self) -> None:
        if self._hf is not None:
            return
        from transformers import AutoTokenizer

        self._hf = AutoTokenizer.from_pretrained(self.directory)
        if self._hf.chat_template is None:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template")
        self._pieces = ChatPieces(lambda msgs, gen: self._hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen))
        footer = self._encode_batch([self._pieces.assistant_footer()])[0]
        special = set(self._hf.all_special_ids)
        self._eot = []
        for t in footer:
            if t not in special:
                break
            self._eot.append(t)
        if not self._eot and self._hf.eos_token_id is not None:
            self._eot = [self._hf.eos_token_id]

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: parallel, and no per-text Python objects
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self._hf(texts, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------------------------------------ planning

    def _plan(self, source: TraceSource, table: _PieceTable) -> _SourcePlan:
        self._load_hf()
        eot = table.fixed("eot", self._eot)
        prompts, responses, per_traj = [], [], []
        for traj in source.trajectories:
            prev: tuple[Call, list[int]] | None = None
            for call in traj.calls:
                if call.prompt_text is not None:
                    pieces = self._text_prompt_pieces(call, prev, table)
                    response = [table.text(call.response)]
                else:
                    pieces = self._chat_prompt_pieces(call, table)
                    response = [table.text(call.response), eot]
                prompts.append(pieces)
                responses.append(response)
                prev = (call, pieces)
            per_traj.append(len(traj.calls))
        return _SourcePlan(prompts, responses, per_traj)

    def _chat_prompt_pieces(self, call: Call, table: _PieceTable) -> list[int]:
        pieces = self._pieces.pieces(call.messages)
        if pieces is None:
            self.stats["whole_prompt_calls"] += 1
            pieces = [self._hf.apply_chat_template(call.messages, tokenize=False, add_generation_prompt=True)]
        return [table.text(p) for p in pieces if p]

    @staticmethod
    def _text_prompt_pieces(call: Call, prev: tuple[Call, list[int]] | None, table: _PieceTable) -> list[int]:
        if prev is not None and prev[0].prompt_text is not None:
            head = prev[0].prompt_text + prev[0].response
            if call.prompt_text.startswith(head):
                rest = call.prompt_text[len(head):]
                return prev[1] + ([table.text(prev[0].response)] if prev[0].response else []) + (
                    [table.text(rest)] if rest else [])
        return [table.text(call.prompt_text)] if call.prompt_text else []

    # ------------------------------------------------------------------------------------------------ packing

    @staticmethod
    def _pack(plan: _SourcePlan, table: _PieceTable) -> dict[str, np.ndarray]:
        """The source's pieces renumbered densely, their token ids, and each call's piece lists."""
        used = sorted({p for lst in plan.prompt_pieces + plan.response_pieces for p in lst})
        local = {p: i for i, p in enumerate(used)}
        lengths = [len(table.tokens[p]) for p in used]

        def flat(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
            ids = np.array([local[p] for lst in lists for p in lst], dtype=np.int32)
            offsets = np.concatenate(([0], np.cumsum([len(lst) for lst in lists]))).astype(np.int64)
            return ids, offsets

        prompt_pieces, prompt_offsets = flat(plan.prompt_pieces)
        response_pieces, response_offsets = flat(plan.response_pieces)
        return {
            "tokens": (np.concatenate([table.tokens[p] for p in used]) if used else np.empty(0)).astype(np.int32),
            "piece_offsets": np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
            "prompt_pieces": prompt_pieces, "prompt_offsets": prompt_offsets,
            "response_pieces": response_pieces, "response_offsets": response_offsets,
            "calls_per_trajectory": np.asarray(plan.calls_per_trajectory, dtype=np.int64),
        }

    @staticmethod
    def _unpack(source: TraceSource, a: dict[str, np.ndarray]) -> list[TokenizedTrajectory]:
        tokens, offsets = a["tokens"], a["piece_offsets"]
        out, n = [], 0
        for traj in source.trajectories:
            calls = []
            for _ in traj.calls:
                prompt = _gather(tokens, offsets, a["prompt_pieces"][a["prompt_offsets"][n]:a["prompt_offsets"][n + 1]])
                response = _gather(tokens, offsets,
                                   a["response_pieces"][a["response_offsets"][n]:a["response_offsets"][n + 1]])
                calls.append(TokenizedCall(prompt, response))
                n += 1
            out.append(TokenizedTrajectory(traj.framework, traj.session_id, calls))
        return out

    # ------------------------------------------------------------------------------------------------ disk cache

    def cache_path(self, source: TraceSource) -> Path:
        key = hashlib.sha256(f"{CACHE_VERSION}\0{self.fingerprint}\0{source.format}\0{source.content_hash}".encode())
        return self.cache_dir / f"{key.hexdigest()[:40]}.npz"

    def _read_cache(self, source: TraceSource) -> dict[str, np.ndarray] | None:
        path = self.cache_path(source)
        if not path.is_file():
            return None
        try:
            with np.load(path) as z:
                a = {k: z[k] for k in z.files}
            if list(a["calls_per_trajectory"]) != [len(t.calls) for t in source.trajectories]:
                raise ValueError("call counts differ from the source")
        except (OSError, ValueError, KeyError) as e:  # a damaged entry is re-tokenised and overwritten
            log.warning("ignoring unreadable tokenisation cache %s (%s)", path, e)
            return None
        return a

    def _write_cache(self, source: TraceSource, arrays: dict[str, np.ndarray]) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, self.cache_path(source))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
