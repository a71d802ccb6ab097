"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`), what Codex CLI and the OpenAI
Agents SDK speak: a request's `instructions` and `input` items (messages of any role, `function_call`,
`function_call_output`) become the chat conversation the engine renders, its function `tools`, `tool_choice`,
`parallel_tool_calls` and `text.format` the same options as chat completions (speculation, tools and grammars alike),
and the reply comes back as output items (a message, function calls), whole or as the typed events clients parse.

`previous_response_id` continues a stored response: its conversation (input and output) goes before the new input.
Responses are stored unless `store` is false, in `ResponseStore`, bounded in memory (the oldest go first). Tools of
other types (web search, image generation, ...) are not callable here and are left out; reasoning items are skipped.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from hybridspec.runtime.options import SamplingOptions
from hybridspec.serve.metrics import finish_reason
from hybridspec.serve.protocol import APIError

RESPONSES = "/v1/responses"
STORE_BYTES = 64 << 20  # stored conversations' JSON, in all


class ResponsesRequest(BaseModel):
    """A Responses API request; fields that change nothing here (reasoning, include, metadata, prompt_cache_key,
    truncation, user, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    speculate: str | None = None  # hybridspec's extension, as in chat completions
    seed: int | None = None

    def function_tools(self) -> list[dict[str, Any]]:
        """The request's function tools in chat completions' shape (other types are not callable here)."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                continue
            if not isinstance(tool.get("name"), str):
                raise APIError(f"tools[{i}].name: a function tool needs a name", f"tools[{i}].name")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        return tools

    def to_options(self, defaults: SamplingOptions) -> SamplingOptions:
        values: dict[str, Any] = dict(max_new_tokens=self.max_output_tokens, temperature=self.temperature,
                                      top_p=self.top_p, speculate=self.speculate, seed=self.seed)
        tools = self.function_tools()
        if tools:
            choice = self.tool_choice
            if isinstance(choice, dict) and choice.get("type") == "function":
                choice = {"type": "function", "function": {"name": choice.get("name")}}
            elif isinstance(choice, dict):
                choice = "auto"  # a built-in tool's choice: none of those runs here
            values.update(tools=tools, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls is not False)
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            values["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
            values["response_format"] = {"type": fmt["type"]}
        return defaults.replace(**{k: v for k, v in values.items() if v is not None})

    def request_field(self, param: str, prompt_field: str) -> str | None:
        fields = {"max_new_tokens": "max_output_tokens", "response_format": "text.format", "prompt": "input"}
        if param.startswith("messages"):
            return "input"
        if param.startswith(("tools", "response_format")):
            return "tools" if param.startswith("tools") else "text.format"
        return fields.get(param, param if param in type(self).model_fields else None)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of the request's `instructions` and `input` (text or items); a 400 names a bad item."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}]: an input item is an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(f"input[{i}].role: {role!r} is not one of system, developer, user, assistant",
                               f"input[{i}].role")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of the turn its text began
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":  # reasoning items (encrypted or summaries) say nothing a model here reads
            raise APIError(f"input[{i}].type: {kind!r} items are not supported (message, function_call, "
                           f"function_call_output, reasoning are)", f"input[{i}].type")
    if not messages:
        raise APIError("input: nothing to respond to", "input")
    return messages


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts (input_text, output_text, text) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        bad = [p.get("type") for p in content if p.get("type") not in ("input_text", "output_text", "text")]
        if not bad:
            return "\n".join(str(p.get("text", "")) for p in content)
        raise APIError(f"{where}: only text parts are supported, not {bad[0]!r}", where)
    raise APIError(f"{where} must be a string or a list of text parts", where)


class ResponseStore:
    """Stored responses, for `previous_response_id` and `GET`: each its body and its whole conversation as chat
    messages, the oldest evicted past `budget_bytes` of their JSON."""

    def __init__(self, budget_bytes: int = STORE_BYTES) -> None:
        self.budget = budget_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.nbytes = 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.budget:
            return
        self._items[response["id"]] = (response, conversation, size)
        self.nbytes += size
        while self.nbytes > self.budget:
            _, (_, _, freed) = self._items.popitem(last=False)
            self.nbytes -= freed

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        item = self._items.get(response_id)
        return None if item is None else (item[0], item[1])

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is not None:
            self.nbytes -= item[2]
        return item is not None


def register(app, server, store: ResponseStore) -> None:
    @app.post(RESPONSES)
    async def create(request: Request):
        body = await server.parse(request, ResponsesRequest)
        return await respond(server, store, body, request)

    @app.get(RESPONSES + "/{response_id}")
    async def retrieve(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise APIError(f"No response with id {response_id!r} is stored", "response_id", 404,
                           type="not_found_error")
        return server.json(stored[0])

    @app.delete(RESPONSES + "/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise APIError(f"No response with id {response_id!r} is stored", "response_id", 404,
                           type="not_found_error")
        return server.json({"id": response_id, "object": "response.deleted", "deleted": True})


async def respond(server, store: ResponseStore, body: ResponsesRequest, request: Request):
    messages = input_messages(body)
    if body.previous_response_id:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise APIError(f"Previous response with id {body.previous_response_id!r} not found",
                           "previous_response_id")
        earlier = [m for m in stored[1] if m["role"] != "system"] if body.instructions else stored[1]
        messages = earlier + messages
    options = server.options(body, "input")
    handle = await server.start(RESPONSES, body, [messages], options, "input")
    reply = Reply(server, body, options)
    if body.stream:
        return server.sse(_events(server, store, handle, reply, messages))
    results = await server.finish(RESPONSES, handle, request, body, "input")
    response = reply.finished(results[0])
    server.metrics.ended(RESPONSES, reply.finish_reason(results[0]), results)
    if body.store is not False:
        store.put(response, messages + reply.conversation(results[0]))
    return server.json(response)


class Reply:
    """One response's body as it is built: its id, its output items, its events' numbers."""

    def __init__(self, server, body: ResponsesRequest, options: SamplingOptions) -> None:
        self.id, self.created, self.body, self.model = f"resp_{uuid.uuid4().hex}", int(time.time()), body, server.model
        self.tools = options.call_tools is not None
        self.options, self.sequence, self.output = options, 0, []

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict[str, Any]:
        o, body = self.options, self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "model": self.model,
                "instructions": body.instructions, "output": self.output, "parallel_tool_calls": o.parallel_tool_calls,
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "temperature": o.temperature,
                "top_p": o.top_p, "max_output_tokens": body.max_output_tokens, "text": body.text or {
                    "format": {"type": "text"}}, "previous_response_id": body.previous_response_id,
                "store": body.store is not False, "reasoning": None, "metadata": getattr(body, "metadata", None) or {},
                "usage": usage}

    def finished(self, result) -> dict[str, Any]:
        """The whole response of a call's result (its output items built here unless streamed already)."""
        if not self.output:
            content, calls = (result.content, result.tool_calls or []) if self.tools else (result.text, [])
            if content or not calls:
                self.output.append(message_item(f"msg_{uuid.uuid4().hex}", content or ""))
            self.output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        cut = self.finish_reason(result) == "length"
        prompt, n = len(result.prompt_token_ids), len(result.token_ids)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": result.stats.cached_tokens},
                 "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + n}
        return self.response("incomplete" if cut else "completed", usage, "max_output_tokens" if cut else None)

    def finish_reason(self, result) -> str:
        return finish_reason(result.finish_reason, bool(self.tools and result.tool_calls))

    def conversation(self, result) -> list[dict[str, Any]]:
        """The reply as chat messages, for a later `previous_response_id`."""
        if self.tools and result.tool_calls:
            return [{"role": "assistant", "content": result.content or "", "tool_calls": result.tool_calls}]
        return [{"role": "assistant", "content": result.content if self.tools else result.text or ""}]

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.sequence, **fields})}\n\n"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


async def _events(server, store: ResponseStore, handle, reply: Reply, messages: list) -> AsyncIterator[str]:
    """The typed events: response.created and .in_progress; per output item its .added, its text or arguments in
    deltas, its .done; response.completed (or .incomplete). Any way this generator ends before the engine call did
    cancels that call."""
    ended, text, current = False, "", None  # the open item: its index in reply.output
    try:
        yield reply.event("response.created", response=reply.response("in_progress"))
        yield reply.event("response.in_progress", response=reply.response("in_progress"))

        def close() -> list[str]:
            nonlocal current, text
            if current is None:
                return []
            item, index = reply.output[current], current
            current, out = None, []
            if item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": []}
                item.update(status="completed", content=[part])
                out += [reply.event("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=text),
                        reply.event("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)]
            else:
                item["status"] = "completed"
                out.append(reply.event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]))
            text = ""
            return out + [reply.event("response.output_item.done", output_index=index, item=item)]

        async for delta in handle.outputs():
            for event in delta.events if reply.tools else [delta.text]:
                if isinstance(event, str):
                    if not event:
                        continue
                    if current is None or reply.output[current]["type"] != "message":
                        for e in close():
                            yield e
                        reply.output.append(message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress"))
                        current = len(reply.output) - 1
                        item = reply.output[current]
                        yield reply.event("response.output_item.added", output_index=current, item=item)
                        yield reply.event("response.content_part.added", item_id=item["id"], output_index=current,
                                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text += event
                    yield reply.event("response.output_text.delta", item_id=reply.output[current]["id"],
                                      output_index=current, content_index=0, delta=event)
                elif "id" in event:  # a call begins
                    for e in close():
                        yield e
                    reply.output.append(call_item(event["id"], event["function"]["name"], "", "in_progress"))
                    current = len(reply.output) - 1
                    yield reply.event("response.output_item.added", output_index=current, item=reply.output[current])
                else:  # its arguments
                    fragment = event["function"]["arguments"]
                    reply.output[current]["arguments"] += fragment
                    yield reply.event("response.function_call_arguments.delta", item_id=reply.output[current]["id"],
                                      output_index=current, delta=fragment)
        for e in close():
            yield e
        result, ended = handle.result, True
        response = reply.finished(result)
        server.metrics.ended(RESPONSES, reply.finish_reason(result), handle.results)
        if reply.body.store is not False:
            store.put(response, messages + reply.conversation(result))
        yield reply.event(f"response.{response['status']}", response=response)
    except Exception as e:  # the engine failed mid-stream (its call has ended): say so in the stream
        if not ended:
            ended = True
            server.metrics.ended(RESPONSES, "error")
        yield reply.event("error", code="server_error", message=f"{type(e).__name__}: {e}", param=None)
    finally:
        if not ended:  # the client went away
            server.metrics.ended(RESPONSES, "abort")
            handle.cancel()
