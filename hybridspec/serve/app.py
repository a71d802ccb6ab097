"""The OpenAI-compatible app on an `Engine`: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
`/metrics`.

Every HTTP request is one engine call: its body becomes the engine's options (`to_options`, over the server's
defaults), the call is submitted, and its handle's text (with tools: its content and tool-call deltas, parsed once by
the engine) is awaited on the event loop as the engine's loop commits it; concurrent requests share the engine's steps
(continuous batching) and each gets what it would get alone. A streaming client that goes away cancels its call, which
leaves the line if it waits or the batch before the next step (its requests aborted, its place and KV freed). Past
the engine's limits a request waits for a place; past its queue's, it is answered 429 (`rate_limit_exceeded`, with
`Retry-After`).
"""
from __future__ import annotations

import json
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
from hybridspec.grammar.tool_calls import Event
from hybridspec.runtime.options import SamplingOptions
from hybridspec.serve.metrics import Metrics, finish_reason
from hybridspec.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, error_response,
                                       param_path)
from hybridspec.serve.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                        ChatCompletionChunk, Completion, CompletionChoice, CompletionChunk, Delta,
                                        ErrorInfo, ErrorResponse, ModelCard, ModelList, PromptTokensDetails, ToolCall,
                                        ToolCallDelta, Usage)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics")
PROMPT_FIELDS = {CHAT: "messages", COMPLETIONS: "prompt"}
# What a request that leaves a field out gets: OpenAI's API defaults (temperature 1, which clients written against it
# expect), and a longer reply than the Python API's 256 tokens (an agent's tool call and its reasoning run longer).
SERVER_DEFAULTS = SamplingOptions(max_new_tokens=1024, temperature=1.0)
# JSON nesting a body may have: far beyond real requests (a tool's schema 40 levels deep fits); a deeper one is refused
# here rather than recursed into later (json, pydantic, the chat template, the grammar compiler: a RecursionError)
MAX_DEPTH = 100


def create_app(engine, served_model_name: str = "smollm2", defaults: SamplingOptions = SERVER_DEFAULTS,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The server's app on `engine`. defaults: what a request that leaves a field out gets (`SERVER_DEFAULTS`; its
    `speculate` is the proposer of requests that name none, its `max_new_tokens` the limit of those that set neither
    max_tokens nor max_completion_tokens). Metrics go to `registry` (default: a new one, this app's own)."""
    app = FastAPI(title="hybridspec", version=_version(), docs_url=None, redoc_url=None)
    server = _Server(engine, served_model_name, defaults,
                     Metrics(registry, getattr(engine, "admission", None), getattr(engine, "passes", None)))
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
        return await server.complete(CHAT, body, [m.model_dump(exclude_none=True) for m in body.messages])

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        return await server.complete(COMPLETIONS, body, body.prompt)

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
    def __init__(self, engine, model: str, defaults: SamplingOptions, metrics: Metrics):
        self.engine, self.model, self.defaults, self.metrics = engine, model, defaults, metrics
        self.created = int(time.time())

    async def complete(self, endpoint: str, body, prompt):
        if body.model is not None and body.model != self.model:
            raise APIError(f"The model `{body.model}` does not exist: this server serves `{self.model}`", "model",
                           404, "model_not_found", "not_found_error")
        try:  # the options and prompt are checked at once (tokenising a long prompt takes a while: a thread)
            options = body.to_options(self.defaults)
            handle = await run_in_threadpool(self.engine.stream, prompt, options)
        except InvalidParameter as e:  # anything else the engine raises is the server's fault: a 500
            code = "context_length_exceeded" if isinstance(e, ContextLengthExceeded) else None
            raise APIError(str(e), body.request_field(e.param, PROMPT_FIELDS[endpoint]), code=code) from None
        except QueueFull as e:  # as OpenAI's rate limits answer
            self.metrics.refused.inc()
            raise APIError(str(e), None, 429, "rate_limit_exceeded", "requests",
                           headers={"Retry-After": str(int(e.retry_after))}) from None
        ids = Ids(endpoint, self.model)
        calls_tools = options.call_tools is not None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _SSE(self._events(endpoint, handle, ids, include_usage, calls_tools),
                        headers={"Cache-Control": "no-cache"})
        try:
            async for _ in handle.outputs():
                pass
        except Exception:  # the engine failed: the server's error handler answers 500
            self.metrics.ended(endpoint, "error")
            raise
        except BaseException:  # cancelled (the server stops)
            self.metrics.ended(endpoint, "abort")
            handle.cancel()
            raise
        result = handle.result
        message = _message(result, calls_tools) if ids.chat else None
        reason = finish_reason(result.finish_reason, bool(message and message.tool_calls))
        self.metrics.ended(endpoint, reason, result)
        return _json(ids.response(result, reason, message))

    async def _events(self, endpoint: str, handle, ids: "Ids", include_usage: bool,
                      calls_tools: bool) -> AsyncIterator[str]:
        """The SSE body: a role chunk (chat), text deltas (with tools: the content and tool-call deltas the engine
        parsed), the chunk with the finish reason, the usage chunk if asked for, `[DONE]`. Any way this generator
        ends before the engine call did cancels that call."""
        ended = False
        try:
            if ids.chat:
                yield _event(ids.role_chunk())
            async for text, events in handle.outputs():
                for event in events if calls_tools else [text]:
                    yield _event(ids.chunk(event))
            result, ended = handle.result, True
            reason = finish_reason(result.finish_reason, bool(calls_tools and result.tool_calls))
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
                handle.cancel()


def _message(result, calls_tools: bool) -> AssistantMessage:
    """A chat reply: its text, or with tools its calls and the text beside them (as the engine parsed them)."""
    if not calls_tools:
        return AssistantMessage(content=result.text)
    if not result.tool_calls:
        return AssistantMessage(content=result.content or "")
    return AssistantMessage(content=result.content,
                            tool_calls=[ToolCall.model_validate(call) for call in result.tool_calls])


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
