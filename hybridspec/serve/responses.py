"""The OpenAI response bodies of the server (pydantic): models whose JSON is what OpenAI's clients parse (as vLLM's
server has them)."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, model_serializer


class _Body(BaseModel):
    """A response body. Its fields are always in the JSON, null or not, except those of `omit_none` while None (as
    OpenAI's bodies leave them out)."""

    omit_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler) -> dict[str, Any]:
        data = handler(self)
        for name in self.omit_none:
            if name in data and data[name] is None:
                del data[name]
        return data


class PromptTokensDetails(_Body):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Body):
    """The reply: its text, or its tool calls (then content is None unless there was text beside them)."""

    omit_none = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobBody(TopLogprob):
    """A token's log-probability in a chat choice's `logprobs.content`, with the most probable tokens beside it."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Body):
    content: list[TokenLogprobBody]


class CompletionLogprobs(_Body):
    """A text completion choice's log-probabilities (the legacy shape): per token its text, log-probability, the
    most probable tokens there ({text: log-probability}) and its offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(_Body):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Body):
    omit_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Body):
    """A streamed piece of the call `index`: its id, type and name first (arguments ""), then argument fragments."""

    omit_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(_Body):
    """A streamed chat delta: the role first ({"role": "assistant", "content": ""}), then text or tool calls, {} with
    the finish."""

    omit_none = ("role", "content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Body):
    """A streamed chat chunk; the last, with stream_options.include_usage, has no choices and the usage."""

    omit_none = ("usage",)
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Body):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Completion):
    """A streamed text completion chunk (a text_completion object too); usage only in the last, as for chat."""

    omit_none = ("usage",)
    usage: Usage | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybridspec"
    max_model_len: int


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Body):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Body):
    error: ErrorInfo
