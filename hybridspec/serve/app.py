"""The app on an `Engine`: the APIs agents speak, one engine call per request. OpenAI's chat and text completions
(`chat.py`), OpenAI's Responses API (`openai_responses.py`), Anthropic's Messages API (`anthropic_messages.py`), and
`/v1/models`, `/health`, `/metrics`.

Every request is one engine call: its body becomes the engine's options (over the server's defaults), the call is
submitted, and its handle's deltas (text, with tools the content and tool-call deltas the engine parsed) are awaited
on the event loop as the engine's loop commits them; concurrent requests share the engine's steps (continuous
batching) and each gets what it would get alone. A client that goes away, streamed or not, cancels its call, which
leaves the line if it waits or the batch before the next step (its requests aborted, its place and KV freed). What a
request may cost is bounded (its body's bytes, its prompt before tokenizing, its grammar), a client's mistake is a 400
naming its field, and with an API key only its holders get past /health. Past the engine's limits a request waits for
a place; past its queue's, it is answered 429 (with `Retry-After`). Errors come in the shape of the API asked (OpenAI's
`{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hybridspec.errors import ContextLengthExceeded, InvalidParameter, QueueFull
from hybridspec.runtime.options import SamplingOptions
from hybridspec.runtime.prompts import valid_unicode
from hybridspec.serve import anthropic_messages, chat, openai_responses
from hybridspec.serve.metrics import Metrics
from hybridspec.serve.protocol import APIError, error_response, param_path
from hybridspec.serve.responses import ModelCard, ModelList

ENDPOINTS = (chat.CHAT, chat.COMPLETIONS, openai_responses.RESPONSES, anthropic_messages.MESSAGES,
             anthropic_messages.COUNT_TOKENS, "/v1/models", "/health", "/metrics")
# What a request that leaves a field out gets: OpenAI's API defaults (temperature 1, which clients written against it
# expect), and a longer reply than the Python API's 256 tokens (an agent's tool call and its reasoning run longer).
SERVER_DEFAULTS = SamplingOptions(max_new_tokens=1024, temperature=1.0)
# JSON nesting a body may have: far beyond real requests (a tool's schema 40 levels deep fits); a deeper one is refused
# here rather than recursed into later (json, pydantic, the chat template, the grammar compiler: a RecursionError)
MAX_DEPTH = 100
# A request body's bytes: an agent's whole 128k-token conversation with its tools is a few MB; past this, a 413 before
# the body is read
MAX_BODY_BYTES = 16 << 20


def create_app(engine, served_model_name: str = "smollm2", defaults: SamplingOptions = SERVER_DEFAULTS,
               registry: CollectorRegistry | None = None,
               response_store_bytes: int = openai_responses.STORE_BYTES, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's app on `engine`. defaults: what a request that leaves a field out gets (`SERVER_DEFAULTS`; its
    `speculate` is the proposer of requests that name none, its `max_new_tokens` the limit of those that set no
    limit). Metrics go to `registry` (default: a new one, this app's own). response_store_bytes: the memory the
    Responses API's stored responses may take (`previous_response_id`; the oldest go first; 0: none kept).
    api_key: where set, every /v1 route and /metrics want it (`Authorization: Bearer KEY`, or `x-api-key: KEY` as
    Anthropic's clients send it); /health stays open. max_body_bytes: a larger body is a 413, unread."""
    app = FastAPI(title="hybridspec", version=_version(), docs_url=None, redoc_url=None)
    server = Server(engine, served_model_name, defaults,
                    Metrics(registry, getattr(engine, "admission", None), getattr(engine, "passes", None)),
                    max_body_bytes)
    app.state.server = server
    app.state.metrics = server.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(request, e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(request, validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(request, APIError(str(e.detail), None, e.status_code, type=kind))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody receives it

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        return _error(request, APIError(f"internal error: {type(e).__name__}: {e}", None, 500, type="server_error"))

    if api_key:
        app.add_middleware(_RequireKey, key=api_key)
    app.add_middleware(_CountResponses, metrics=server.metrics)  # added last: it runs first, and counts the 401s

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return server.json(ModelList(data=[server.model_card()]))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        server.check_model(model_id)
        return server.json(server.model_card())

    chat.register(app, server)
    openai_responses.register(app, server, openai_responses.ResponseStore(response_store_bytes))
    anthropic_messages.register(app, server)
    return app


def _error(request: Request, e: APIError) -> JSONResponse:
    return error_for(request.url.path, e)


def error_for(path: str, e: APIError) -> JSONResponse:
    """An error in the shape of the API the request asked: Anthropic's under /v1/messages, else OpenAI's."""
    if path.startswith(anthropic_messages.MESSAGES):
        return anthropic_messages.error_response(e)
    return e.response()


def validation_error(errors: list) -> APIError:
    """pydantic's first error as a 400 naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(f"{param}: {message}" if param else f"the body: {message}", param)


class Server:
    """What every API's routes share: the engine, the served model's name, the defaults of a request's options, the
    metrics; parsing a body, starting an engine call with the API's errors, awaiting or streaming its end."""

    def __init__(self, engine, model: str, defaults: SamplingOptions, metrics: Metrics,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.engine, self.model, self.defaults, self.metrics = engine, model, defaults, metrics
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model, created=self.created, max_model_len=self.engine.target.max_seq_len)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise APIError(f"The model `{model}` does not exist: this server serves `{self.model}`", "model", 404,
                           "model_not_found", "not_found_error")

    async def parse(self, request: Request, model: type[BaseModel]):
        """The request body as `model`: at most max_body_bytes (a 413 otherwise, the rest unread), JSON whatever the
        Content-Type says (curl -d sends a form's), no deeper than MAX_DEPTH, its text valid Unicode, its model the
        served one."""
        try:
            data = json.loads(await self._body(request))
        except UnicodeDecodeError:
            raise APIError("the body is not valid UTF-8", None, code="json_invalid") from None
        except ValueError as e:
            raise APIError(f"the body is not valid JSON: {e}", None, code="json_invalid") from None
        except RecursionError:
            raise APIError(f"the body is nested more than {MAX_DEPTH} levels deep", None) from None
        problem = _check_json(data, MAX_DEPTH)
        if problem is not None:
            field, what = problem
            raise APIError(f"{field or 'the body'} {what}", field or None)
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e.errors()) from None
        self.check_model(getattr(body, "model", None))
        return body

    async def _body(self, request: Request) -> bytes:
        too_large = APIError(f"the body is larger than this server takes ({self.max_body_bytes} bytes)", None, 413,
                             "request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # it left while sending: no answer, and no 500 counted
            raise ClientGone() from None
        return b"".join(chunks)

    def options(self, body, prompt_field: str) -> SamplingOptions:
        """The engine's options for a request (`to_options` over the server's defaults), its errors as 400s naming
        the request's field."""
        try:
            return body.to_options(self.defaults)
        except InvalidParameter as e:
            raise APIError(str(e), body.request_field(e.param, prompt_field)) from None

    async def start(self, endpoint: str, body, prompts: list, options: SamplingOptions, prompt_field: str = ""):
        """Submit the engine call of `prompts` (its deltas streamed to its handle); an `InvalidParameter` is a 400
        naming the request's field, `QueueFull` a 429. Tokenising a long prompt takes a while: a thread does it."""
        prompt_field = prompt_field or chat.PROMPT_FIELDS.get(endpoint, "messages")
        try:
            return await run_in_threadpool(self.engine.submit, prompts, options, True)
        except InvalidParameter as e:  # anything else the engine raises is the server's fault: a 500
            code = "context_length_exceeded" if isinstance(e, ContextLengthExceeded) else None
            raise APIError(str(e), body.request_field(e.param, prompt_field), code=code) from None
        except QueueFull as e:  # as OpenAI's rate limits answer
            self.metrics.refused.inc()
            raise APIError(str(e), None, 429, "rate_limit_exceeded", "requests",
                           headers={"Retry-After": str(int(e.retry_after))}) from None

    async def finish(self, endpoint: str, handle, request: Request, body=None, prompt_field: str = "") -> list:
        """Await the call's end; its results. A client that goes away meanwhile cancels the call (its place and KV
        freed before the next step; counted "abort"). A refusal found as the call ran (a schema that cannot be
        completed) is a 400 naming the request's field; any other engine failure is counted and raised: a 500."""
        left = asyncio.ensure_future(_disconnected(request))
        left.add_done_callback(lambda task: task.cancelled() or handle.cancel())
        try:
            async for _ in handle.outputs():
                pass
        except InvalidParameter as e:
            self.metrics.ended(endpoint, "error")
            raise APIError(str(e), body.request_field(e.param, prompt_field or chat.PROMPT_FIELDS.get(
                endpoint, "messages")) if body is not None else None) from None
        except Exception:
            self.metrics.ended(endpoint, "error")
            raise
        except BaseException:  # cancelled (the server stops)
            self.metrics.ended(endpoint, "abort")
            handle.cancel()
            raise
        finally:
            left.cancel()
        if handle.results is None:  # the client left: nobody reads an answer
            self.metrics.ended(endpoint, "abort")
            raise ClientGone()
        return handle.results

    def token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def count_tokens(self, prompt, tools) -> int:
        return len(self.engine.encode(prompt, tools))

    @staticmethod
    def json(body: BaseModel | dict) -> Response:
        text = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
        return Response(text, media_type="application/json")

    @staticmethod
    def sse(events: AsyncIterator[str]) -> StreamingResponse:
        return _SSE(events, headers={"Cache-Control": "no-cache"})


def _check_json(data: Any, limit: int) -> tuple[str, str] | None:
    """The first field of `data` (its path, "" for the body itself) nested deeper than `limit` or holding text that is
    not valid Unicode (a lone surrogate, "\\ud800", which JSON allows and no tokenizer takes), and what is wrong."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            if not valid_unicode(item):
                return param_path(path) or "", "holds text that is not valid Unicode (a lone surrogate)"
        elif isinstance(item, (dict, list)):
            if depth > limit:
                return param_path(path[:1]) or "", f"is nested more than {limit} levels deep"
            if isinstance(item, dict):
                for key, value in item.items():
                    if not valid_unicode(key):
                        return param_path(path) or "", "holds a key that is not valid Unicode (a lone surrogate)"
                    stack.append((value, depth + 1, (*path, key)))
            else:
                stack.extend((value, depth + 1, (*path, i)) for i, value in enumerate(item))
    return None


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (its body already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client of a request went away before its answer: nothing is sent."""


def _version() -> str:
    from hybridspec import __version__

    return __version__


class _RequireKey:
    """The API key on every /v1 route and /metrics (`Authorization: Bearer KEY` or `x-api-key: KEY`), compared in
    constant time; a 401 in the API's shape otherwise. /health stays open (for load balancers and probes)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith("/v1") or path == "/metrics"):
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope.get("headers", [])}
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        error = APIError("a valid API key is required (Authorization: Bearer KEY)", None, 401, "invalid_api_key",
                         "authentication_error" if path.startswith(anthropic_messages.MESSAGES) else
                         "invalid_request_error", headers={"WWW-Authenticate": "Bearer"})
        await error_for(path, error)(scope, receive, send)


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


__all__ = ["create_app", "SERVER_DEFAULTS", "Server", "error_response"]
