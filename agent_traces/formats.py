"""Agent log formats: every LLM call of an agent run as a (prompt, response) pair, in call order.

Supported sources (auto-detected; a directory is searched recursively):
- SWE-agent v0.x `.traj`: `history` is the message list sent to the model; each assistant entry is one call whose
  prompt is the history before it.
- mini-swe-agent `.traj.json` (`trajectory_format: "mini-swe-agent-1"`): the same rule over `messages`.
- AutoCodeRover task directories (`conversation_round_<R>.json`, `agent_proxy_<R>.json`,
  `debug_agent_write_patch_<K>.json`, `info.log`): the call order is rebuilt from the files and checked against the
  `Raw model response` lines of `info.log`.
- Generic JSONL (`*.jsonl`), one call per line, for users' own logs. A line is one of
    {"session_id": "s1", "messages": [{"role": "user", "content": "..."}, ...], "response": "..."}
    {"session_id": "s1", "prompt": "plain completion text", "response": "..."}
    {"session_id": "s1", "request": {OpenAI chat.completions request}, "response": {OpenAI chat.completion}}
  `prompt` may also hold a message list. `session_id` is optional (default: the file name) and so is `framework`
  (default "generic"). Calls of a session are replayed in line order, sessions in order of first appearance.
  Message content may be a string, null, or a list of OpenAI content parts of type "text".
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

Message = dict[str, str]


class TraceFormatError(ValueError):
    """A trace file (or task directory) that cannot be read; the message names the path."""

    def __init__(self, path: str | Path, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class UnknownFormatError(TraceFormatError):
    """A path that is none of the supported agent log formats."""


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM call: the prompt (chat messages, or `prompt_text` for a plain completion) and the logged response."""

    session_id: str
    index: int
    messages: list[Message]
    response: str
    prompt_text: str | None = None


@dataclass(slots=True)
class Trajectory:
    """The calls of one agent run (a session), in call order."""

    framework: str
    session_id: str
    calls: list[Call] = field(default_factory=list)


@dataclass(slots=True)
class TraceSource:
    """One file or task directory and the trajectories read from it; `content_hash` covers every byte read."""

    path: Path
    format: str
    trajectories: list[Trajectory]
    content_hash: str


@dataclass(slots=True)
class LoadResult:
    sources: list[TraceSource]
    skipped: list[tuple[Path, str]]  # (path, reason) of bad sources passed over with skip_bad

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for s in self.sources for t in s.trajectories]


class _Reader:
    """Reads the bytes of a source's files, hashing them in order, and parses JSON with errors that name the file."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def read_bytes(self, path: Path) -> bytes:
        data = path.read_bytes()
        self._hash.update(path.name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        self._hash.update(data)
        return data

    def read_json(self, path: Path) -> Any:
        try:
            return json.loads(self.read_bytes(path))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceFormatError(path, f"malformed or truncated JSON ({e})") from None

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _content(value: Any, where: str, path: Path) -> str:
    """Message content as text: a string, null (a tool-call-only message), or OpenAI text parts."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise TraceFormatError(path, f"{where}: message content must be a string or a list of text parts")


def _messages(raw: Any, where: str, path: Path) -> list[Message]:
    if not isinstance(raw, list):
        raise TraceFormatError(path, f"{where}: expected a list of messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise TraceFormatError(path, f"{where}[{i}]: a message needs a string 'role' and a 'content'")
        out.append({"role": m["role"], "content": _content(m["content"], f"{where}[{i}]", path)})
    return out


def _thread_calls(session_id: str, thread: list[Message], start: int = 0, first_index: int = 0) -> list[Call]:
    """A thread's assistant messages at positions >= start, each a call whose prompt is everything before it."""
    calls = []
    for i in range(start, len(thread)):
        if thread[i]["role"] == "assistant":
            calls.append(Call(session_id, first_index + len(calls), thread[:i], thread[i]["content"]))
    return calls


def _session_id(path: Path, root: Path, suffix: str = "") -> str:
    rel = path.relative_to(root) if path != root and path.is_relative_to(root) else Path(path.name)
    text = rel.as_posix()
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text


# ---------------------------------------------------------------------------------------------------------- loaders

def _load_swe_agent(path: Path, root: Path) -> TraceSource:
    reader = _Reader()
    data = reader.read_json(path)
    if not isinstance(data, dict) or "history" not in data:
        raise TraceFormatError(path, "not a SWE-agent trajectory (no 'history')")
    sid = _session_id(path, root, ".traj")
    calls = _thread_calls(sid, _messages(data["history"], "history", path))
    return TraceSource(path, "swe-agent", [Trajectory("SWE-agent", sid, calls)], reader.hexdigest())


def _load_mini_swe_agent(path: Path, root: Path) -> TraceSource:
    reader = _Reader()
    data = reader.read_json(path)
    if not isinstance(data, dict) or "messages" not in data:
        raise TraceFormatError(path, "not a mini-swe-agent trajectory (no 'messages')")
    sid = _session_id(path, root, ".traj.json")
    calls = _thread_calls(sid, _messages(data["messages"], "messages", path))
    return TraceSource(path, "mini-swe-agent", [Trajectory("mini-swe-agent", sid, calls)], reader.hexdigest())


_NUMBERED = re.compile(r"_(\d+)\.json$")
# One line per call in info.log; the content is a Python string literal (repr never spans lines).
_RAW_RESPONSE = re.compile(
    r"Raw model response: ChatCompletionMessage\(content=(None|'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")")


def _numbered(directory: Path, stem: str) -> dict[int, Path]:
    return {int(m.group(1)): p for p in directory.glob(f"{stem}_*.json") if (m := _NUMBERED.search(p.name))}


def _load_autocoderover(path: Path, root: Path) -> TraceSource:
    """Rebuild an AutoCodeRover task's call order.

    conversation_round_<R>.json is the main thread as it stood when round R began, so the highest-numbered one is the
    whole main thread. Round R's first main call is followed by its JSON-extraction helper calls (agent_proxy_<R>.json,
    one [system, user, assistant] thread per retry). The patch-writing calls come last: the assistant messages that
    the highest-numbered debug_agent_write_patch_<K>.json adds after its copy of the main thread.
    """
    reader = _Reader()
    rounds = _numbered(path, "conversation_round")
    if not rounds:
        raise UnknownFormatError(path, "no conversation_round_<R>.json: not an AutoCodeRover task directory")
    round_threads = {r: _messages(reader.read_json(p), p.name, path) for r, p in sorted(rounds.items())}
    main = round_threads[max(round_threads)]
    proxies = {r: reader.read_json(p) for r, p in sorted(_numbered(path, "agent_proxy").items())}
    sid = _session_id(path, root)

    calls: list[Call] = []
    pending = sorted(proxies)
    if pending and pending[-1] not in round_threads:
        raise TraceFormatError(path, f"agent_proxy_{pending[-1]}.json has no conversation_round_{pending[-1]}.json")
    for i, msg in enumerate(main):
        if msg["role"] != "assistant":
            continue
        calls.append(Call(sid, len(calls), main[:i], msg["content"]))
        while pending and i >= len(round_threads[pending[0]]):
            r = pending.pop(0)
            if not isinstance(proxies[r], list):
                raise TraceFormatError(path, f"agent_proxy_{r}.json: expected a list of message threads")
            for k, thread in enumerate(proxies[r]):
                msgs = _messages(thread, f"agent_proxy_{r}.json[{k}]", path)
                if not msgs or msgs[-1]["role"] != "assistant":
                    raise TraceFormatError(path, f"agent_proxy_{r}.json[{k}]: thread does not end with a response")
                calls.append(Call(sid, len(calls), msgs[:-1], msgs[-1]["content"]))
    if pending:
        raise TraceFormatError(path, f"agent_proxy_{pending[0]}.json belongs to a round with no main call")

    patches = _numbered(path, "debug_agent_write_patch")
    if patches:
        name = patches[max(patches)].name
        patch_thread = _messages(reader.read_json(patches[max(patches)]), name, path)
        # The patch thread replaces the system prompt and copies the rest of the main thread.
        if [m["content"] for m in patch_thread[1:len(main)]] != [m["content"] for m in main[1:]]:
            raise TraceFormatError(path, f"{name} does not continue the main conversation thread")
        calls += _thread_calls(sid, patch_thread, start=len(main), first_index=len(calls))

    log = path / "info.log"
    if log.is_file():
        logged = [None if m.group(1) == "None" else ast.literal_eval(m.group(1))
                  for m in _RAW_RESPONSE.finditer(reader.read_bytes(log).decode("utf-8", errors="replace"))]
        rebuilt = [c.response for c in calls]
        if logged != rebuilt:
            first = next((i for i, (a, b) in enumerate(zip(logged, rebuilt)) if a != b), min(len(logged), len(rebuilt)))
            raise TraceFormatError(path, f"rebuilt call order disagrees with info.log at call {first} "
                                         f"({len(rebuilt)} calls rebuilt, {len(logged)} logged)")
    return TraceSource(path, "autocoderover", [Trajectory("AutoCodeRover", sid, calls)], reader.hexdigest())


def _jsonl_call(obj: Any, where: str, path: Path) -> tuple[list[Message], str | None, str]:
    """(messages, prompt_text, response) of one generic-JSONL line."""
    if not isinstance(obj, dict):
        raise TraceFormatError(path, f"{where}: expected a JSON object")
    if "request" in obj:  # OpenAI chat-completions request/response pair
        request, response = obj["request"], obj.get("response")
        if not isinstance(request, dict) or "messages" not in request:
            raise TraceFormatError(path, f"{where}: 'request' must be a chat.completions request with 'messages'")
        messages = _messages(request["messages"], f"{where}: request.messages", path)
        if isinstance(response, dict):
            try:
                response = response["choices"][0]["message"].get("content")
            except (KeyError, IndexError, TypeError, AttributeError):
                raise TraceFormatError(path, f"{where}: 'response' has no choices[0].message") from None
        return messages, None, _content(response, f"{where}: response", path)
    prompt = obj.get("messages", obj.get("prompt"))
    if prompt is None or "response" not in obj:
        raise TraceFormatError(path, f"{where}: a call needs 'messages' (or 'prompt') and 'response'")
    response = _content(obj["response"], f"{where}: response", path)
    if isinstance(prompt, str):
        return [], prompt, response
    return _messages(prompt, f"{where}: messages", path), None, response


def _load_jsonl(path: Path, root: Path) -> TraceSource:
    reader = _Reader()
    try:
        text = reader.read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(path, f"not UTF-8 text ({e})") from None
    default_session = _session_id(path, root, ".jsonl")
    sessions: dict[tuple[str, str], Trajectory] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(path, f"line {lineno}: malformed or truncated JSON ({e})") from None
        messages, prompt_text, response = _jsonl_call(obj, f"line {lineno}", path)
        framework = str(obj.get("framework", "generic"))
        sid = str(obj.get("session_id", default_session))
        traj = sessions.setdefault((framework, sid), Trajectory(framework, sid))
        traj.calls.append(Call(sid, len(traj.calls), messages, response, prompt_text))
    if not sessions:
        raise TraceFormatError(path, "no calls in the file")
    return TraceSource(path, "jsonl", list(sessions.values()), reader.hexdigest())


LOADERS: dict[str, Callable[[Path, Path], TraceSource]] = {
    "swe-agent": _load_swe_agent,
    "mini-swe-agent": _load_mini_swe_agent,
    "autocoderover": _load_autocoderover,
    "jsonl": _load_jsonl,
}


def detect_format(path: str | Path) -> str:
    """The format of a file or task directory, by its name and first bytes; UnknownFormatError otherwise."""
    path = Path(path)
    if path.is_dir():
        if _numbered(path, "conversation_round"):
            return "autocoderover"
        raise UnknownFormatError(path, "a directory that is not an AutoCodeRover task directory")
    if not path.is_file():
        raise TraceFormatError(path, "no such file or directory")
    if path.name.endswith(".jsonl"):
        return "jsonl"
    if path.name.endswith(".traj.json"):
        return "mini-swe-agent"
    if path.name.endswith(".traj"):
        return "swe-agent"
    with open(path, "rb") as f:
        head = f.read(1 << 16).decode("utf-8", errors="replace")
    stripped = head.lstrip()
    if '"trajectory_format"' in head and '"mini-swe-agent' in head:
        return "mini-swe-agent"
    if stripped.startswith("{") and '"history"' in head and '"trajectory"' in head:
        return "swe-agent"
    first_line = stripped.split("\n", 1)[0]
    if first_line.startswith("{") and first_line.rstrip().endswith("}") and '"response"' in first_line:
        return "jsonl"
    raise UnknownFormatError(path, "unknown trace format (expected SWE-agent .traj, mini-swe-agent .traj.json, "
                                   "an AutoCodeRover task directory or generic .jsonl)")


def _is_trace_name(name: str) -> bool:
    return name.endswith((".traj", ".traj.json", ".jsonl"))


def discover(paths: Iterable[str | Path]) -> list[Path]:
    """The sources under `paths`, sorted within each argument: explicit files and task directories as given;
    directories searched recursively for .traj, .traj.json, .jsonl files and AutoCodeRover task directories."""
    found: list[Path] = []
    for arg in paths:
        arg = Path(arg)
        if not arg.is_dir() or _numbered(arg, "conversation_round"):
            found.append(arg)
            continue
        matches = []
        for directory, subdirs, files in _walk(arg):
            if _numbered(directory, "conversation_round"):
                matches.append(directory)
                subdirs.clear()
                continue
            matches += [directory / f for f in files if _is_trace_name(f)]
        if not matches:
            raise TraceFormatError(arg, "no agent traces found in this directory")
        found += sorted(matches)
    return found


def _walk(root: Path) -> Iterator[tuple[Path, list[str], list[str]]]:
    for directory, subdirs, files in os.walk(root):
        subdirs.sort()
        yield Path(directory), subdirs, files


def load_source(path: str | Path, root: str | Path | None = None, fmt: str | None = None) -> TraceSource:
    """Read one file or task directory. Session ids are paths relative to `root` (default: the parent)."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in LOADERS:
        raise ValueError(f"unknown format {fmt!r}; known: {sorted(LOADERS)}")
    root_path = Path(root) if root is not None else path.parent
    try:
        return LOADERS[fmt](path, root_path)
    except OSError as e:
        raise TraceFormatError(path, f"cannot read ({e})") from None


def load_traces(paths: Sequence[str | Path] | str | Path, skip_bad: bool = False) -> LoadResult:
    """Load every source under `paths`. A bad source raises TraceFormatError, or with skip_bad is listed in
    `skipped` and the rest is loaded."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    sources, skipped = [], []
    for arg in paths:
        arg = Path(arg)
        root = arg if arg.is_dir() and not _numbered(arg, "conversation_round") else arg.parent
        try:
            found = discover([arg])
        except TraceFormatError as e:
            if not skip_bad:
                raise
            skipped.append((e.path, e.reason))
            continue
        for path in found:
            try:
                sources.append(load_source(path, root))
            except TraceFormatError as e:
                if not skip_bad:
                    raise
                skipped.append((e.path, e.reason))
    return LoadResult(sources, skipped)


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path, openai: bool = False) -> None:
    """Write trajectories in the generic JSONL format (or its OpenAI request/response line variant)."""
    with open(path, "w", encoding="utf-8") as f:
        for traj in trajectories:
            for call in traj.calls:
                line: dict[str, Any] = {"framework": traj.framework, "session_id": traj.session_id}
                if openai:
                    if call.prompt_text is not None:
                        raise ValueError("a plain-text prompt has no chat-completions form")
                    line["request"] = {"messages": call.messages}
                    line["response"] = {"object": "chat.completion", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": call.response}}]}
                else:
                    line["prompt" if call.prompt_text is not None else "messages"] = (
                        call.prompt_text if call.prompt_text is not None else call.messages)
                    line["response"] = call.response
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
