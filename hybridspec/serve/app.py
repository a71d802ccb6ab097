"""The OpenAI-compatible app on an `Engine`: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
`/metrics`.

Every HTTP request is one engine call (`Engine.stream`), so concurrent requests share decode steps (continuous
batching) and each gets what it would get alone. Tools, tool_choice and response_format go to the engine, which
constrains the output with a grammar; a reply's `<tool_call>` blocks come back as OpenAI's `tool_calls` (streamed as
`delta.tool_calls` once each call is complete). The engine blocks, so its calls run in worker threads, one step per
thread hop while streaming: the event loop never waits on a step. A streaming client that goes away is cancelled at
the next step, or leaves the line if it waits (its requests aborted, its place and KV freed). Past the engine's
limits a request waits for a place; past its queue's, it is answered 429 (`rate_limit_exceeded`, with
`Retry-After`).
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridspec.errors import ContextLengthExceeded, InvalidParameter, QueueFull
from hybridspec.grammar.tool_calls import Event, ToolCallStreamParser, parse_tool_calls
from hybridspec.serve.metrics import Metrics, finish_reason
from hybridspec.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, error_response,
                                       param_path)
from hybridspec.serve.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                        ChatCompletionChunk, Completion, CompletionChoice, CompletionChunk, Delta,
                                        ErrorInfo, ErrorResponse, ModelCard, ModelList, PromptTokensDetails, ToolCall,
                                        ToolCallDelta, Usage)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics")
# The engine's names of a request's parameters (`InvalidParameter.param`) -> the request's fields. The prompt is the
# endpoint's field; a chat message's fields ("messages[1].content") are named alike in both; the others the server
# never sets from a request (tree, num_speculative_tokens) name no field.
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "speculate": "speculate", "stop": "stop", "seed": "seed", "tool_choice": "tool_choice",
                  "parallel_tool_calls": "parallel_tool_calls"}
PROMPT_FIELDS = {CHAT: "messages", COMPLETIONS: "prompt"}
NESTED_FIELDS = ("messages", "tools", "response_format")  # fields whose inner names the engine's params use as is
# JSON nesting a body may have: far beyond real requests (a tool's schema 40 levels deep fits); a deeper one is refused
# here rather than recursed into later (json, pydantic, the chat template, the grammar compiler: a RecursionError)
MAX_DEPTH = 100


def create_app(engine, served_model_name: str = "smollm2", speculate: str = "suffix", max_tokens: int = 1024,
               registry: CollectorRegistry | None = None, grammar_drafts: bool = True) -> FastAPI:
    """The server's app on `engine`. speculate: the proposer of requests that do not name one (the request field
    `speculate` overrides it); max_tokens: the limit of requests that set neither max_tokens nor
    max_completion_tokens; grammar_drafts: under a grammar, draft the tokens it forces (`Engine.generate`). Metrics
    go to `registry` (default: a new one, this app's own)."""
    app = FastAPI(title="hybridspec", version=_version(), docs_url=None, redoc_url=None)
    server = _Server(engine, served_model_name, speculate, max_tokens,
                     Metrics(registry, getattr(engine, "admission", None), getattr(engine, "passes", None)),
                     grammar_drafts)
    app.state.server = server
    app.state.metrics = server.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(str(e.detail), None, e.status_code, type=kind)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        return error_response(f"internal error: {type(e).__name__}: {e}", None, 500, type="server_error")

    app.add_middleware(_CountResponses, metrics=server.metrics)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList(data=[ModelCard(id=served_model_name, created=server.created,
                                               max_model_len=engine.target.max_seq_len)]))

    @app.post(CHAT)
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        return await server.complete(CHAT, body, messages, body.max_completion_tokens or body.max_tokens)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        return await server.complete(COMPLETIONS, body, body.prompt, body.max_tokens)

    return app


async def _parse(request: Request, model: type[BaseModel]):
    """The request body as `model`: JSON whatever the Content-Type says (curl -d sends a form's), no deeper than
    MAX_DEPTH."""
    try:
        data = json.loads(await request.body())
    except ValueError as e:
        raise APIError(f"the body is not valid JSON: {e}", None, code="json_invalid") from None
    except RecursionError:
        raise APIError(f"the body is nested more than {MAX_DEPTH} levels deep", None) from None
    field = _too_deep(data, MAX_DEPTH)
    if field is not None:
        raise APIError(f"{field or 'the body'} is nested more than {MAX_DEPTH} levels deep", field or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


def _too_deep(data: Any, limit: int) -> str | None:
    """The top-level field of `data` nested deeper than `limit` ("" for the body itself), or None."""
    for field, value in data.items() if isinstance(data, dict) else [("", data)]:
        stack = [(value, 2)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, (dict, list)):
                if depth > limit:
                    return field
                stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return None


def _validation_error(errors: list) -> APIError:
    """pydantic's first error as a 400 naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(f"{param}: {message}" if param else f"the body: {message}", param)


def _version() -> str:
    from hybridspec import __version__

    return __version__


class _CountResponses:
    """Counts every HTTP response by endpoint and status (an ASGI middleware: it leaves streaming alone)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        counted = False

        async def counting_send(message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if not counted:  # an exception before any response: the server's error handler answers 500
                self.metrics.http_requests.labels(endpoint, "500").inc()


class _SSE(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (finished, or the client gone and
    the send failing), so that its `finally` cancels the engine call at once rather than when collected."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class _Server:
    def __init__(self, engine, model: str, speculate: str, max_tokens: int, metrics: Metrics, grammar_drafts: bool):
        self.engine, self.model, self.speculate, self.max_tokens = engine, model, speculate, max_tokens
        self.metrics, self.grammar_drafts = metrics, grammar_drafts
        self.created = int(time.time())

    def options(self, body, max_tokens: int | None) -> dict[str, Any]:
        """The engine's options for a request (OpenAI's defaults: temperature 1, top_p 1)."""
        if body.model is not None and body.model != self.model:
            raise APIError(f"The model `{body.model}` does not exist: this server serves `{self.model}`", "model",
                           404, "model_not_found", "not_found_error")
        tools = body.tool_options() if isinstance(body, ChatCompletionRequest) else {}
        response_format = body.response_format and body.response_format.model_dump(by_alias=True, exclude_none=True)
        return dict(max_new_tokens=max_tokens or self.max_tokens,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                    speculate=body.speculate or self.speculate, stop=body.stop, seed=body.seed,
                    response_format=response_format, grammar_drafts=self.grammar_drafts, **tools)

    async def complete(self, endpoint: str, body, prompt, max_tokens: int | None):
        options = self.options(body, max_tokens)
        try:  # the call validates its options and prompt at once (tokenising it takes the engine's lock: a thread)
            stream = await run_in_threadpool(self.engine.stream, prompt, **options)
        except InvalidParameter as e:  # anything else the engine raises is the server's fault: a 500
            code = "context_length_exceeded" if isinstance(e, ContextLengthExceeded) else None
            raise APIError(str(e), self.field(e.param, endpoint, body), code=code) from None
        except QueueFull as e:  # as OpenAI's rate limits answer
            self.metrics.refused.inc()
            raise APIError(str(e), None, 429, "rate_limit_exceeded", "requests",
                           headers={"Retry-After": str(int(e.retry_after))}) from None
        ids = Ids(endpoint, self.model)
        calls_tools = isinstance(body, ChatCompletionRequest) and body.calls_tools()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _SSE(self._events(endpoint, stream, ids, include_usage, calls_tools),
                        headers={"Cache-Control": "no-cache"})
        pump = _Pump(stream)
        try:
            async for _ in pump:
                pass
        except Exception:  # the engine failed: the server's error handler answers 500
            self.metrics.ended(endpoint, "error")
            raise
        except BaseException:  # cancelled (the server stops)
            self.metrics.ended(endpoint, "abort")
            pump.cancel()
            raise
        result = stream.result
        message = _message(result, calls_tools) if ids.chat else None
        reason = finish_reason(result.finish_reason, bool(message and message.tool_calls))
        self.metrics.ended(endpoint, reason, result)
        return _json(ids.response(result, reason, message))

    async def _events(self, endpoint: str, stream, ids: "Ids", include_usage: bool,
                      calls_tools: bool) -> AsyncIterator[str]:
        """The SSE body: a role chunk (chat), text deltas (with tools: content and tool-call deltas, as
        `ToolCallStreamParser` sends them), the chunk with the finish reason, the usage chunk if asked for,
        `[DONE]`. Any way this generator ends before the engine call did cancels that call. (A response whose client
        is gone before its first byte never starts it: the engine call, never started, holds nothing.)"""
        ended = False
        pump = _Pump(stream)
        parser = ToolCallStreamParser() if calls_tools else None
        try:
            if ids.chat:
                yield _event(ids.role_chunk())
            async for delta in pump:
                for event in parser.feed(delta) if parser else [delta]:
                    yield _event(ids.chunk(event))
            for event in parser.finish() if parser else []:
                yield _event(ids.chunk(event))
            result, ended = stream.result, True
            reason = finish_reason(result.finish_reason, bool(parser and parser.calls))
            self.metrics.ended(endpoint, reason, result)
            yield _event(ids.chunk(None, reason))
            if include_usage:
                yield _event(ids.usage_chunk(result))
            yield "data: [DONE]\n\n"
        except Exception as e:  # the engine failed mid-stream (its call has ended): say so in the stream
            if not ended:
                ended = True
                self.metrics.ended(endpoint, "error")
            yield _event(ErrorResponse(error=ErrorInfo(message=f"{type(e).__name__}: {e}", type="server_error")))
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away (this task cancelled, or the generator closed)
                self.metrics.ended(endpoint, "abort")
                pump.cancel()

    @staticmethod
    def field(param: str, endpoint: str, body) -> str | None:
        """The request field named by the engine's parameter `param` (REQUEST_FIELDS; the fields of messages, tools
        and response_format as the engine names them, "tools[0].function.parameters")."""
        if param == "prompt":
            return PROMPT_FIELDS[endpoint]
        if re.split(r"[.\[]", param, maxsplit=1)[0] in NESTED_FIELDS:
            return param
        if param == "max_new_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            return "max_completion_tokens"
        return REQUEST_FIELDS.get(param)


class _Pump:
    """Runs an engine stream to its end in a thread of its own and hands its text deltas to the event loop as they
    come (`async for delta in pump`). The thread goes straight back for the next decode step, so concurrent requests
    share steps as in-process calls do: a thread hop per delta would leave a request out of every step that starts
    while its delta is on its way. `cancel()` ends the engine call at its next step (the thread closes the stream)."""

    _END = object()

    def __init__(self, stream) -> None:
        self.stream, self._cancelled = stream, threading.Event()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._thread: threading.Thread | None = None

    def cancel(self) -> None:
        self._cancelled.set()
        if self._thread is None:  # never started: it gives up its place in line
            self.stream.close()
        else:  # it leaves the line, or the batch at its next step, prompt chunks included
            self.stream.cancel()

    def _run(self) -> None:
        try:
            for delta in self.stream:
                if self._cancelled.is_set():
                    break
                self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except Exception as e:  # noqa: BLE001 - the engine's error, raised on the event loop's side
            self._loop.call_soon_threadsafe(self._queue.put_nowait, e)
        finally:
            self.stream.close()  # here, where the stream runs: a no-op once it has ended
            self._loop.call_soon_threadsafe(self._queue.put_nowait, self._END)

    async def __aiter__(self) -> AsyncIterator[str]:
        self._thread = threading.Thread(target=self._run, name="hybridspec-request", daemon=True)
        self._thread.start()
        while (item := await self._queue.get()) is not self._END:
            if isinstance(item, Exception):
                raise item
            yield item


def _message(result, calls_tools: bool) -> AssistantMessage:
    """A chat reply: its text, or with tools its calls and the text beside them (the engine's parse where it made one,
    the same `parse_tool_calls` otherwise)."""
    if not calls_tools:
        return AssistantMessage(content=result.text)
    calls = getattr(result, "tool_calls", None)
    content, calls = (result.content, calls) if calls is not None else parse_tool_calls(result.text)
    if not calls:
        return AssistantMessage(content=content or "")
    return AssistantMessage(content=content, tool_calls=[ToolCall.model_validate(call) for call in calls])


def _event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


class Ids:
    """One request's response bodies: its id and timestamp on the chat or text completion models."""

    def __init__(self, endpoint: str, model: str):
        self.chat = endpoint == CHAT
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model, self.created = model, int(time.time())

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    @staticmethod
    def usage(result) -> Usage:
        prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=result.stats.cached_tokens))

    def response(self, result, reason: str, message: AssistantMessage | None) -> ChatCompletion | Completion:
        """The whole response: chat's `message`, or the text."""
        if self.chat:
            return ChatCompletion(**self._head(), usage=self.usage(result),
                                  choices=[ChatChoice(message=message, finish_reason=reason)])
        return Completion(**self._head(), usage=self.usage(result),
                          choices=[CompletionChoice(text=result.text, finish_reason=reason)])

    def role_chunk(self) -> ChatCompletionChunk:
        """A chat stream's first chunk: the role."""
        return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(delta=Delta(role="assistant",
                                                                                        content=""))])

    def chunk(self, event: Event | None, reason: str | None = None) -> ChatCompletionChunk | CompletionChunk:
        """A streamed chunk: text, a tool-call delta (chat), or nothing with the finish reason (chat's delta is then
        {})."""
        if self.chat:
            delta = Delta(tool_calls=[ToolCallDelta.model_validate(event)]) if isinstance(event, dict) else \
                Delta(content=event)
            return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(delta=delta, finish_reason=reason)])
        return CompletionChunk(**self._head(), choices=[CompletionChoice(text=event or "", finish_reason=reason)])

    def usage_chunk(self, result) -> ChatCompletionChunk | CompletionChunk:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return (ChatCompletionChunk if self.chat else CompletionChunk)(**self._head(), choices=[],
                                                                        usage=self.usage(result))
