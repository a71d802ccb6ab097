"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), what Claude-Code-style clients
and the `anthropic` SDK speak: `system`, messages of content blocks (text, `tool_use`, `tool_result`), `tools` with
`input_schema` and `tool_choice` become the chat conversation and options the engine runs (speculation, tools and
grammars as in chat completions), and the reply comes back as content blocks, whole or as Anthropic's streaming
events. Errors come as Anthropic's `{"type": "error", "error": {"type", "message"}}`; `x-api-key` is accepted.
Fields that change nothing here (metadata, thinking, context_management, service_tier, ...) are accepted and ignored;
a `max_tokens` past the context ends the reply at the context's end ("max_tokens").
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from hybridspec.runtime.options import SamplingOptions
from hybridspec.serve.protocol import APIError

MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int = Field(..., gt=0)
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    speculate: str | None = None  # hybridspec's extension, as in chat completions

    def chat_tools(self) -> list[dict[str, Any]]:
        """The request's custom tools in chat completions' shape (server tools of other types are left out)."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type", "custom") != "custom":
                continue
            if not isinstance(tool.get("name"), str):
                raise APIError(f"tools.{i}.name: a tool needs a name", f"tools.{i}.name")
            function = {"name": tool["name"], **({"description": tool["description"]} if tool.get("description")
                                                 else {}), "parameters": tool.get("input_schema") or {"type": "object"},
                        **({"strict": tool["strict"]} if tool.get("strict") is not None else {})}
            tools.append({"type": "function", "function": function})  # in the order chat completions' tools have
        return tools

    def to_options(self, defaults: SamplingOptions) -> SamplingOptions:
        values: dict[str, Any] = dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                      top_k=self.top_k, stop=self.stop_sequences or None, speculate=self.speculate)
        tools, choice = self.chat_tools(), self.tool_choice or {"type": "auto"}
        kind = choice.get("type")
        if tools:
            values.update(tools=tools, parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
                          tool_choice={"auto": "auto", "any": "required", "none": "none"}.get(kind) or (
                              {"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                              else kind))
        elif kind in ("any", "tool"):
            raise APIError(f"tool_choice {kind!r} needs tools", "tool_choice")
        return defaults.replace(**{k: v for k, v in values.items() if v is not None})

    def request_field(self, param: str, prompt_field: str) -> str | None:
        if param == "prompt" or param.startswith("messages"):
            return "messages"
        fields = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}
        return fields.get(param, param.split(".")[0].split("[")[0] if param.split(".")[0].split("[")[0] in
                          type(self).model_fields else None)


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The chat messages of `system` and `messages`: tool results become tool messages (before the user's text
    beside them), tool uses an assistant's tool calls; a 400 names a block that is not text or a tool's. A message
    with the role "system" (which Claude Code sends) joins the system prompt, which chat templates want first."""
    systems = [text_of(body.system)] + [text_of(m.get("content")) for m in body.messages if m.get("role") == "system"]
    system = "\n\n".join(s for s in systems if s)
    messages = [{"role": "system", "content": system}] if system else []
    if all(m.get("role") == "system" for m in body.messages):
        raise APIError("messages: a request needs a user or assistant message besides the system prompt", "messages")
    for i, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content")
        if role == "system":
            continue
        if role not in ("user", "assistant"):
            raise APIError(f"messages.{i}.role: {role!r} is not user, assistant or system", f"messages.{i}.role")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(f"messages.{i}.content must be a string or a list of blocks", f"messages.{i}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind, where = block.get("type") if isinstance(block, dict) else None, f"messages.{i}.content.{j}"
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": text_of(block.get("content"))})
            elif kind not in ("thinking", "redacted_thinking"):
                raise APIError(f"{where}.type: {kind!r} blocks are not supported in a {role} message here (text, "
                               f"tool_use, tool_result are)", f"{where}.type")
        if texts or calls or role == "assistant":
            messages.append({"role": role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})})
    return messages


def text_of(content: Any) -> str:
    """The text of a system prompt or a message's content: a string, or its text blocks."""
    if isinstance(content, str) or content is None:
        return content or ""
    return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")


def error_response(e: APIError) -> JSONResponse:
    """An error as Anthropic's API answers it."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers=e.headers)


def register(app, server) -> None:
    @app.post(MESSAGES)
    async def messages(request: Request):
        body = await server.parse(request, MessagesRequest)
        return await respond(server, body, request)

    @app.post(COUNT_TOKENS)
    async def count_tokens(request: Request):
        from starlette.concurrency import run_in_threadpool

        body = await server.parse(request, CountTokensRequest)
        tools = MessagesRequest.chat_tools(body)
        count = await run_in_threadpool(server.count_tokens, chat_messages(body), tools or None)
        return server.json({"input_tokens": count})


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # not part of a count_tokens request


async def respond(server, body: MessagesRequest, request: Request):
    messages = chat_messages(body)
    options = server.options(body, "messages")
    handle = await server.start(MESSAGES, body, [messages], options, "messages")
    reply = Reply(server.model, options.call_tools is not None)
    if body.stream:
        return server.sse(_events(server, handle, reply))
    results = await server.finish(MESSAGES, handle, request, body, "messages")
    server.metrics.ended(MESSAGES, reply.stop_reason(results[0]), results)
    return server.json(reply.message(results[0]))


class Reply:
    def __init__(self, model: str, tools: bool) -> None:
        self.id, self.model, self.tools = f"msg_{uuid.uuid4().hex}", model, tools

    def stop_reason(self, result) -> str:
        if self.tools and result.tool_calls:
            return "tool_use"
        return {"length": "max_tokens", "stop": "stop_sequence"}.get(result.finish_reason, "end_turn")

    @staticmethod
    def usage(result) -> dict[str, int]:
        cached = result.stats.cached_tokens
        return {"input_tokens": len(result.prompt_token_ids) - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": len(result.token_ids)}

    def message(self, result) -> dict[str, Any]:
        content, calls = (result.content, result.tool_calls or []) if self.tools else (result.text, [])
        blocks = [{"type": "text", "text": content}] if content else []
        blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": json.loads(c["function"]["arguments"])} for c in calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": blocks,
                "stop_reason": self.stop_reason(result), "stop_sequence": result.stop, "usage": self.usage(result)}


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


async def _events(server, handle, reply: Reply) -> AsyncIterator[str]:
    """message_start; per content block content_block_start, its deltas (text_delta, or a tool's input as
    input_json_delta), content_block_stop; message_delta with the stop reason; message_stop. Any way this generator
    ends before the engine call did cancels that call."""
    ended, index, open_kind = False, -1, None
    try:
        yield event("message_start", message={"id": reply.id, "type": "message", "role": "assistant", "content": [],
                                              "model": reply.model, "stop_reason": None, "stop_sequence": None,
                                              "usage": {"input_tokens": 0, "output_tokens": 0}})
        yield event("ping")
        async for delta in handle.outputs():
            for item in delta.events if reply.tools else [delta.text]:
                if isinstance(item, str):
                    if not item:
                        continue
                    if open_kind != "text":
                        if open_kind is not None:
                            yield event("content_block_stop", index=index)
                        index, open_kind = index + 1, "text"
                        yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": item})
                elif "id" in item:  # a tool use begins
                    if open_kind is not None:
                        yield event("content_block_stop", index=index)
                    index, open_kind = index + 1, "tool_use"
                    yield event("content_block_start", index=index, content_block={
                        "type": "tool_use", "id": item["id"], "name": item["function"]["name"], "input": {}})
                else:
                    yield event("content_block_delta", index=index, delta={
                        "type": "input_json_delta", "partial_json": item["function"]["arguments"]})
        if open_kind is not None:
            yield event("content_block_stop", index=index)
        result, ended = handle.result, True
        server.metrics.ended(MESSAGES, reply.stop_reason(result), handle.results)
        yield event("message_delta", delta={"stop_reason": reply.stop_reason(result), "stop_sequence": result.stop},
                    usage=reply.usage(result))
        yield event("message_stop")
    except Exception as e:  # the engine failed mid-stream (its call has ended): say so in the stream
        if not ended:
            ended = True
            server.metrics.ended(MESSAGES, "error")
        yield event("error", error={"type": "api_error", "message": f"{type(e).__name__}: {e}"})
    finally:
        if not ended:  # the client went away
            server.metrics.ended(MESSAGES, "abort")
            handle.cancel()
