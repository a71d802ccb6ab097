"""The OpenAI request bodies of the server (pydantic), and OpenAI-style errors (the responses: `responses`).

Each request converts to the engine's one options object (`to_options`), over the server's defaults; an error the
engine raises names the option by its own name, which `request_field` turns back into the request's field through
one table (`REQUEST_FIELDS`).

Request fields the OpenAI API defines that do not change the output here (`user`, `metadata`, `store`, ...) are
accepted and ignored; those that would change it and are not supported (`UNSUPPORTED`: `n` > 1, log-probabilities,
penalties, the legacy `functions`, ...; `CHAT_ONLY` on text completions: tools) are rejected with a 400 naming the
field, rather than silently ignored. Tools, `tool_choice` and `response_format` are checked here as far as the request
alone tells (a tool_choice naming no tool); the engine checks what needs its grammar compiler (a JSON schema).
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from hybridspec.runtime.options import SamplingOptions
from hybridspec.serve.responses import ErrorInfo, ErrorResponse

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16  # choices per request
# The engine's options (`SamplingOptions`, `InvalidParameter.param`) -> the request fields that set them. The prompt is
# the endpoint's field ("messages" or "prompt"); an option not here (tree, num_speculative_tokens) no request sets.
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "speculate": "speculate", "stop": "stop", "seed": "seed", "response_format": "response_format",
                  "tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "parallel_tool_calls",
                  "logprobs": "logprobs", "ignore_eos": "ignore_eos"}


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.message, self.param, self.status, self.code, self.type, self.headers)


def error_response(message: str, param: str | None = None, status: int = 400, code: str | None = None,
                   type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


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


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1)
    arguments: Any = "{}"  # OpenAI's is a JSON string; a JSON object is taken too

    @field_validator("arguments")
    @classmethod
    def _json(cls, arguments: Any) -> str | dict[str, Any]:
        if not isinstance(arguments, (str, dict)):  # (a union type's errors would name its members in the field)
            raise ValueError("arguments must be a JSON string or object")
        return arguments


class MessageToolCall(BaseModel):
    """A call of an earlier assistant message, as the response had it."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """A chat message: an assistant's may carry the `tool_calls` it made (and then no content), a tool message the
    `tool_call_id` it answers; `name` and other extra keys go to the chat template as they are."""

    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    content: Any = Field(None, validate_default=True)  # validated last: it may be None where tool_calls are given

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return call_id

    @field_validator("content")
    @classmethod
    def _text(cls, content: Any, info: ValidationInfo) -> str | None:
        """A string, or OpenAI's list of content parts of type "text" (joined with newlines, as vLLM does); None only
        for an assistant message's tool calls."""
        if isinstance(content, str):
            return content
        if content is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return None
            raise ValueError("content is missing")
        if isinstance(content, list):
            parts = [ContentPart.model_validate(p) if isinstance(p, dict) else None for p in content]
            if all(p is not None and p.type == "text" and isinstance(p.text, str) for p in parts):
                return "\n".join(p.text for p in parts)
            raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
        raise ValueError("content must be a string or a list of text content parts")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: that function must be called."""

    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """{"type": "text"}, {"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _given(cls, spec: JSONSchemaFormat | None, info: ValidationInfo) -> JSONSchemaFormat | None:
        if info.data.get("type") == "json_schema" and (spec is None or spec.schema_ is None):
            raise ValueError('type "json_schema" needs json_schema.schema')
        return spec


# Request fields that would change the output and are not supported: field -> (the values accepted, those that change
# nothing here, compared with ==; why others are not). Both endpoints check them all, so that echo on a chat request
# (vLLM's extension) is refused there too rather than ignored; text completions refuse CHAT_ONLY's as well.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "best_of must be 1"),
    "frequency_penalty": ((None, 0), "only 0"),
    "presence_penalty": ((None, 0), "only 0"),
    "logit_bias": ((None, {}), "no logit bias"),
    "functions": ((None, []), "the legacy functions API: use tools"),
    "function_call": ((None, "none", "auto"), "the legacy functions API: use tool_choice"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "no insertion"),
}
CHAT_ONLY: dict[str, tuple[tuple, str]] = {
    "tools": ((None, []), "tools need chat messages: use /v1/chat/completions"),
    "tool_choice": ((None, "none", "auto"), "tools need chat messages: use /v1/chat/completions"),
}


def unsupported_errors(data: Any, refused: dict[str, tuple[tuple, str]] = UNSUPPORTED) -> list[InitErrorDetails]:
    """pydantic errors, one per field of `data` (a request body) that `refused` refuses, each located at its field."""
    if not isinstance(data, dict):
        return []
    return [InitErrorDetails(type=PydanticCustomError("unsupported", "{field} is not supported by this server ({why})",
                                                      {"field": name, "why": why}), loc=(name,), input=data[name])
            for name, (allowed, why) in refused.items() if name in data and data[name] not in allowed]


def field_error(model: type[BaseModel], field: str, message: str, value: Any) -> ValidationError:
    """A validation error located at a request's field (a plain ValueError in a model validator would name none)."""
    return ValidationError.from_exception_data(model.__name__, [InitErrorDetails(
        type=PydanticCustomError("invalid", message), loc=(field,), input=value)])


class _Request(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")
    refused: ClassVar[dict[str, tuple[tuple, str]]] = UNSUPPORTED
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # choices: samples of the prompt, which runs once
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    seed: int | None = None
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    speculate: str | None = None  # hybridspec's extension: the proposer of this request ("suffix", "none", ...)
    ignore_eos: bool | None = None  # vLLM's extension: run to max_tokens

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        errors = unsupported_errors(data, cls.refused)
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

    def to_options(self, defaults: SamplingOptions) -> SamplingOptions:
        """The engine's options for this request: `defaults` (the server's) with what the request sets."""
        return defaults.replace(**self.option_values())

    def option_values(self) -> dict[str, Any]:
        """The options this request sets, by the engine's names."""
        values = dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                      top_k=None if self.top_k is None else max(0, self.top_k), speculate=self.speculate,
                      stop=self.stop, seed=self.seed, ignore_eos=self.ignore_eos, logprobs=self.top_logprob_count(),
                      response_format=self.response_format and self.response_format.model_dump(
                          by_alias=True, exclude_none=True))
        return {name: value for name, value in values.items() if value is not None}

    def top_logprob_count(self) -> int | None:
        """How many of the most probable tokens to return beside each token's log-probability (None: none)."""
        return None

    def request_field(self, param: str, prompt_field: str) -> str | None:
        """The field of this request that an engine error's `param` names (`REQUEST_FIELDS`; a chat message's,
        a tool's or response_format's inner fields as the engine names them, "tools[0].function.parameters")."""
        if param == "prompt":
            return prompt_field
        if re.split(r"[.\[]", param, maxsplit=1)[0] in ("messages", "tools", "response_format"):
            return param
        return REQUEST_FIELDS.get(param)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_of(cls, choice: Any) -> Any:
        """One error for any other value (the union's would each name a member in the field)."""
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
                and isinstance(choice["function"].get("name"), str):
            return choice
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')

    @model_validator(mode="after")
    def _tool_choice(self) -> "ChatCompletionRequest":
        """A tool_choice that asks for a call needs a tool to call: "required" some tool, a named one that tool."""
        names = [tool.function.name for tool in self.tools or []]
        choice = self.tool_choice
        if choice == "required" and not names:
            raise field_error(type(self), "tool_choice", 'tool_choice "required" needs tools', choice)
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error(type(self), "tool_choice", f"tool_choice names the function {choice.function.name!r}, "
                              f"which is not one of the tools ({', '.join(names) or 'none given'})",
                              choice.model_dump())
        if len(set(names)) < len(names):
            raise field_error(type(self), "tools", "two tools have the same name", names)
        if self.top_logprobs and not self.logprobs:
            raise field_error(type(self), "top_logprobs", "top_logprobs needs logprobs: true", self.top_logprobs)
        return self

    def option_values(self) -> dict[str, Any]:
        """The options this request sets: the common ones, max_completion_tokens over max_tokens, and the tools as
        plain dicts with their choice ("auto" or "none" without tools: unset)."""
        values = super().option_values()
        if self.max_completion_tokens is not None:
            values["max_new_tokens"] = self.max_completion_tokens
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []]
        if tools:
            choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else \
                self.tool_choice
            values.update(tools=tools, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls is not False)
        return values

    def request_field(self, param: str, prompt_field: str) -> str | None:
        if param == "max_new_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"  # the field the limit came from
        return super().request_field(param, prompt_field)

    def calls_tools(self) -> bool:
        """Whether the output may hold tool calls (to be parsed into `tool_calls`)."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Request):
    refused: ClassVar[dict[str, tuple[tuple, str]]] = {**UNSUPPORTED, **CHAT_ONLY}
    prompt: Any = Field(...)
    logprobs: int | None = Field(None, ge=0, le=20)  # the legacy API's: how many most probable tokens beside each

    def top_logprob_count(self) -> int | None:
        return self.logprobs

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
