"""OpenAI's chat and text completions (`/v1/chat/completions`, `/v1/completions`) on the server's engine: a request
is one engine call of `n` samples of its prompt (sharing the prompt's KV), answered whole or streamed as chunks, its
text and tool calls as the engine parsed them, with the target's log-probabilities where asked for."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request

from hybridspec.grammar.tool_calls import Event
from hybridspec.serve.metrics import finish_reason
from hybridspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from hybridspec.serve.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                        ChatCompletionChunk, ChoiceLogprobs, Completion, CompletionChoice,
                                        CompletionChunk, CompletionLogprobs, Delta, ErrorInfo, ErrorResponse,
                                        PromptTokensDetails, ToolCall, ToolCallDelta, TokenLogprobBody, TopLogprob,
                                        Usage)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PROMPT_FIELDS = {CHAT: "messages", COMPLETIONS: "prompt"}


def register(app, server) -> None:
    """The two routes on `app`, answered by `server` (`hybridspec.serve.app.Server`)."""
    @app.post(CHAT)
    async def chat_completions(request: Request):
        body = await server.parse(request, ChatCompletionRequest)
        return await complete(server, CHAT, body, [m.model_dump(exclude_none=True) for m in body.messages], request)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        body = await server.parse(request, CompletionRequest)
        return await complete(server, COMPLETIONS, body, body.prompt, request)


async def complete(server, endpoint: str, body, prompt, request: Request):
    options = server.options(body, PROMPT_FIELDS[endpoint])
    handle = await server.start(endpoint, body, [prompt] * body.n, options)
    ids = Ids(endpoint, server.model, server.token_text)
    tools = options.call_tools is not None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return server.sse(_events(server, endpoint, handle, ids, include_usage, tools, body.n))
    results = await server.finish(endpoint, handle, request, body)
    if ids.chat:
        messages = [_message(r, tools) for r in results]
        reasons = [finish_reason(r.finish_reason, bool(m.tool_calls)) for r, m in zip(results, messages)]
    else:
        messages, reasons = [None] * len(results), [finish_reason(r.finish_reason) for r in results]
    server.metrics.ended(endpoint, reasons[0], results)
    return server.json(ids.response(results, reasons, messages))


async def _events(server, endpoint: str, handle, ids: "Ids", include_usage: bool, tools: bool,
                  n: int) -> AsyncIterator[str]:
    """The SSE body: a role chunk per choice (chat), text deltas (with tools: the content and tool-call deltas the
    engine parsed), each choice's chunk with its finish reason, the usage chunk if asked for, `[DONE]`. Any way this
    generator ends before the engine call did cancels that call."""
    ended = False
    try:
        if ids.chat:
            for index in range(n):
                yield sse(ids.role_chunk(index))
        async for delta in handle.outputs():
            events = (delta.events if tools else [delta.text]) or [""]
            for k, event in enumerate(events):  # the delta's log-probabilities go with its first event
                if event or (k == 0 and delta.logprobs):
                    yield sse(ids.chunk(delta.index, event, logprobs=delta.logprobs if k == 0 else None))
        results, ended = handle.results, True
        reasons = [finish_reason(r.finish_reason, bool(tools and r.tool_calls)) for r in results]
        server.metrics.ended(endpoint, reasons[0], results)
        for index, reason in enumerate(reasons):
            yield sse(ids.chunk(index, None, reason))
        if include_usage:
            yield sse(ids.usage_chunk(results))
        yield "data: [DONE]\n\n"
    except Exception as e:  # the engine failed mid-stream (its call has ended): say so in the stream
        if not ended:
            ended = True
            server.metrics.ended(endpoint, "error")
        yield sse(ErrorResponse(error=ErrorInfo(message=f"{type(e).__name__}: {e}", type="server_error")))
        yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client went away (this task cancelled, or the generator closed)
            server.metrics.ended(endpoint, "abort")
            handle.cancel()


def _message(result, tools: bool) -> AssistantMessage:
    """A chat reply: its text, or with tools its calls and the text beside them (as the engine parsed them)."""
    if not tools:
        return AssistantMessage(content=result.text)
    if not result.tool_calls:
        return AssistantMessage(content=result.content or "")
    return AssistantMessage(content=result.content,
                            tool_calls=[ToolCall.model_validate(call) for call in result.tool_calls])


def sse(body) -> str:
    return f"data: {body.model_dump_json()}\n\n"


class Ids:
    """One request's response bodies: its id and timestamp on the chat or text completion models; token_text(id):
    a token's text, for log-probabilities."""

    def __init__(self, endpoint: str, model: str, token_text=str):
        self.chat = endpoint == CHAT
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model, self.created, self.token_text = model, int(time.time()), token_text

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    @staticmethod
    def usage(results) -> Usage:
        prompt, completion = len(results[0].prompt_token_ids), sum(len(r.token_ids) for r in results)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=results[0].stats.cached_tokens))

    def response(self, results, reasons: list[str],
                 messages: list[AssistantMessage | None]) -> ChatCompletion | Completion:
        """The whole response: each choice's `message` (chat) or text."""
        if self.chat:
            return ChatCompletion(**self._head(), usage=self.usage(results), choices=[
                ChatChoice(index=i, message=m, finish_reason=reason, logprobs=self.chat_logprobs(r.logprobs))
                for i, (r, m, reason) in enumerate(zip(results, messages, reasons))])
        return Completion(**self._head(), usage=self.usage(results), choices=[
            CompletionChoice(index=i, text=r.text, finish_reason=reason, logprobs=self.text_logprobs(r.logprobs))
            for i, (r, reason) in enumerate(zip(results, reasons))])

    def role_chunk(self, index: int = 0) -> ChatCompletionChunk:
        """A chat stream's first chunk of a choice: the role."""
        return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(index=index, delta=Delta(
            role="assistant", content=""))])

    def chunk(self, index: int, event: Event | None, reason: str | None = None,
              logprobs=None) -> ChatCompletionChunk | CompletionChunk:
        """A streamed chunk of choice `index`: text, a tool-call delta (chat), or nothing with the finish reason
        (chat's delta is then {}); the log-probabilities of the tokens it carries, where asked for."""
        if self.chat:
            delta = Delta(tool_calls=[ToolCallDelta.model_validate(event)]) if isinstance(event, dict) else \
                Delta(content=event)
            return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(
                index=index, delta=delta, finish_reason=reason, logprobs=self.chat_logprobs(logprobs or None))])
        return CompletionChunk(**self._head(), choices=[CompletionChoice(
            index=index, text=event or "", finish_reason=reason, logprobs=self.text_logprobs(logprobs or None))])

    def usage_chunk(self, results) -> ChatCompletionChunk | CompletionChunk:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return (ChatCompletionChunk if self.chat else CompletionChunk)(**self._head(), choices=[],
                                                                        usage=self.usage(results))

    def chat_logprobs(self, logprobs) -> ChoiceLogprobs | None:
        if logprobs is None:
            return None
        return ChoiceLogprobs(content=[TokenLogprobBody(
            **self._token(lp.token, lp.logprob),
            top_logprobs=[TopLogprob(**self._token(t, v)) for t, v in lp.top]) for lp in logprobs])

    def text_logprobs(self, logprobs) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = [self.token_text(lp.token) for lp in logprobs]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs], text_offset=offsets,
                                  top_logprobs=[{self.token_text(t): v for t, v in lp.top} for lp in logprobs])

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}
