"""The OpenAI request bodies the server accepts (pydantic), and OpenAI-style errors.

Fields the OpenAI API defines that do not change the output here (`user`, `metadata`, `store`, ...) are accepted and
ignored; fields that would change it and are not supported (`n` > 1, tools, log-probabilities, penalties, JSON
output) are rejected with a 400 naming the field, rather than silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status)


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


def _reject(value: Any, allowed: tuple, name: str, what: str) -> Any:
    if value not in allowed:
        raise ValueError(f"{name} is not supported by this server ({what})")
    return value


class _Request(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    n: int | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculate: str | None = None  # hybridspec's extension: the proposer of this request ("suffix", "none", ...)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: Any = None
    logit_bias: dict | None = None
    response_format: dict | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, n):
        return _reject(n, (None, 1), "n", "one choice per request: n must be 1")

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, value, info):
        return _reject(value, (None, 0), info.field_name, "only 0")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        return _reject(value, (None, False, 0), "logprobs", "no log-probabilities")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        return _reject(value or None, (None,), "logit_bias", "no logit bias")

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value):
        if value is not None and value.get("type") != "text":
            raise ValueError("response_format is not supported by this server (only {\"type\": \"text\"})")
        return value

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
    tools: list | None = None
    functions: list | None = None
    tool_choice: Any = None
    top_logprobs: int | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value, info):
        return _reject(value or None, (None,), info.field_name, "no tool calling: describe the tools in the prompt")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value):
        return _reject(value, (None, "none", "auto"), "tool_choice", "no tool calling")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value):
        return _reject(value or None, (None,), "top_logprobs", "no log-probabilities")


class CompletionRequest(_Request):
    prompt: Any = Field(...)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

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

    @field_validator("echo")
    @classmethod
    def _echo(cls, value):
        return _reject(value, (None, False), "echo", "the prompt is not echoed")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value):
        return _reject(value, (None, 1), "best_of", "best_of must be 1")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value):
        return _reject(value or None, (None,), "suffix", "no insertion")
