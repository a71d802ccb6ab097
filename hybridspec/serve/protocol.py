"""The OpenAI request and response bodies of the server (pydantic), and OpenAI-style errors.

Request fields the OpenAI API defines that do not change the output here (`user`, `metadata`, `store`, ...) are
accepted and ignored; those that would change it and are not supported (`UNSUPPORTED`: `n` > 1, tools,
log-probabilities, penalties, JSON output, ...) are rejected with a 400 naming the field, rather than silently ignored.
Responses are models whose JSON is what OpenAI's clients parse (as vLLM's server has them).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

ROLES = ("system", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def response(self) -> JSONResponse:
        return error_response(self.message, self.param, self.status, self.code, self.type)


def error_response(message: str, param: str | None = None, status: int = 400, code: str | None = None,
                   type: str = "invalid_request_error") -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def param_path(loc: tuple | list) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ("body", "messages", 0, "content") ->
    "messages[0].content"."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat message; `name`, `tool_call_id` and other extra keys are accepted and not used."""

    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    content: Any = Field(...)

    @field_validator("content")
    @classmethod
    def _text(cls, content: Any) -> str:
        """A string, or OpenAI's list of content parts of type "text" (joined with newlines, as vLLM does)."""
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [ContentPart.model_validate(p) if isinstance(p, dict) else None for p in content]
            if all(p is not None and p.type == "text" and isinstance(p.text, str) for p in parts):
                return "\n".join(p.text for p in parts)
            raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
        raise ValueError("content must be a string or a list of text content parts")


# Request fields that would change the output and are not supported: field -> (the values accepted, those that change
# nothing here, compared with ==; why others are not). Both endpoints check them all, so that echo on a chat request
# (vLLM's extension) or tools on a text completion are refused there too rather than ignored.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "one choice per request: n must be 1"),
    "best_of": ((None, 1), "best_of must be 1"),
    "frequency_penalty": ((None, 0), "only 0"),
    "presence_penalty": ((None, 0), "only 0"),
    "logprobs": ((None, False, 0), "no log-probabilities"),
    "top_logprobs": ((None, 0), "no log-probabilities"),
    "logit_bias": ((None, {}), "no logit bias"),
    "response_format": ((None, {"type": "text"}), 'only {"type": "text"}'),
    "tools": ((None, []), "no tool calling: describe the tools in the prompt"),
    "functions": ((None, []), "no tool calling: describe the tools in the prompt"),
    "tool_choice": ((None, "none", "auto"), "no tool calling"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "no insertion"),
}


def unsupported_errors(data: Any) -> list[InitErrorDetails]:
    """pydantic errors, one per field of `data` (a request body) that UNSUPPORTED refuses, each located at its field."""
    if not isinstance(data, dict):
        return []
    return [InitErrorDetails(type=PydanticCustomError("unsupported", "{field} is not supported by this server ({why})",
                                                      {"field": name, "why": why}), loc=(name,), input=data[name])
            for name, (allowed, why) in UNSUPPORTED.items() if name in data and data[name] not in allowed]


class _Request(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    seed: int | None = None
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculate: str | None = None  # hybridspec's extension: the proposer of this request ("suffix", "none", ...)

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        errors = unsupported_errors(data)
        if errors:  # a ValidationError keeps each error's location (a ValueError here would name no field)
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else None
        if stop is not None and (stops is None or any(not isinstance(s, str) or not s for s in stops)):
            raise ValueError("stop must be a non-empty string or a list of them")
        return stops or None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)


class CompletionRequest(_Request):
    prompt: Any = Field(...)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        """A string or a list of token ids; a list of one string is that string."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("one prompt per request (a list of prompts is not supported)")
        if not isinstance(prompt, str) and not (isinstance(prompt, list)
                                                and all(type(t) is int for t in prompt)):
            raise ValueError("prompt must be a string or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt


# ---------------------------------------------------------------------------------------------------- responses


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


class AssistantMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Body):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Body):
    """A streamed chat delta: the role first ({"role": "assistant", "content": ""}), then text, {} with the finish."""

    omit_none = ("role", "content")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Body):
    index: int = 0
    delta: Delta
    logprobs: None = None
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
    logprobs: None = None
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
