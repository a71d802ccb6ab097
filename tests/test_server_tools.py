"""Tool calling and structured output through `hybridspec serve`, over real HTTP: the `openai` client and litellm on a
tiny random Llama (tool_choice required, named, auto, none; a conversation with tool results; streamed calls equal the
non-streamed ones; JSON and JSON-schema output that validates), what the server hands the engine and makes of its
output (a recording engine), each bad tool or format field a 400 naming it, and SmolLM2 calling a bash tool (slow)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from hybridspec.cli import main as cli_main
from hybridspec.errors import InvalidParameter
from hybridspec.model.target import TargetModel
from hybridspec.runtime.engine import Engine
from hybridspec.serve import create_app
from hybridspec.serve.app import SERVER_DEFAULTS
from test_server import CHAT, COMPLETIONS, FakeHandle, Server, delta, metrics, sse

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]  # short: the tools template's system turn fills half the tiny context
F = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}
G = {"type": "function", "function": {"name": "g", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
TOOLS = [F, G]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
NAMED_G = {"type": "function", "function": {"name": "g"}}
GREEDY = dict(temperature=0, max_tokens=160)


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    return Engine(TargetModel(tiny_model), tiny_tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    s = Server(create_app(engine, served_model_name=MODEL))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of a reply's tool calls (an openai message or a plain dict), ids left out."""
    out = []
    for call in (message.tool_calls if not isinstance(message, dict) else message["tool_calls"]) or []:
        function = call.function if not isinstance(call, dict) else call["function"]
        name, arguments = (function.name, function.arguments) if not isinstance(function, dict) else \
            (function["name"], function["arguments"])
        out.append((name, json.loads(arguments)))
    return out


def check_arguments(message, tools=TOOLS) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, arguments in calls(message):
        jsonschema.validate(arguments, schemas[name])


def reassemble(chunks) -> tuple[str, list[tuple[str, dict]], list[str], str]:
    """A streamed reply as a client rebuilds it: content, calls, their ids and the finish reason."""
    content, parts, reasons = "", {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            part = parts.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            assert call.id is None or call.id == part["id"]
            part["arguments"] += call.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    assert len(reasons) == 1
    ordered = [parts[i] for i in sorted(parts)]
    assert sorted(parts) == list(range(len(parts)))
    return content, [(p["name"], json.loads(p["arguments"])) for p in ordered], [p["id"] for p in ordered], reasons[0]


# ---------------------------------------------------------------------------------------------------- tool calls


@pytest.mark.parametrize("choice", ["required", NAMED_G], ids=["required", "named"])
def test_forced_tool_choice_returns_calls(client, engine, choice):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, **GREEDY)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None and message.tool_calls
    assert all(c.type == "function" and c.id.startswith("call_") for c in message.tool_calls)
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    if choice == NAMED_G:
        assert {name for name, _ in calls(message)} == {"g"}
    check_arguments(message)
    ref = engine.generate(MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0, max_new_tokens=160)
    assert calls(message) == calls({"tool_calls": ref.tool_calls}) and out.usage.completion_tokens == \
        len(ref.token_ids)


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_auto_and_none_answer_as_the_engine_does(client, engine, choice):
    kwargs = {} if choice is None else {"tool_choice": choice}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **kwargs, **GREEDY)
    ref = engine.generate(MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0, max_new_tokens=160)
    message = out.choices[0].message
    if choice == "none":  # the tools are in the prompt, but the text is not parsed
        assert message.content == ref.text and message.tool_calls is None
    else:
        assert calls(message) == calls({"tool_calls": ref.tool_calls})
        assert message.content == (ref.content if ref.tool_calls else ref.content or "")
        check_arguments(message)
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


@pytest.mark.parametrize("choice", ["required", NAMED_G, "auto"], ids=["required", "named", "auto"])
def test_streamed_calls_equal_the_response(client, choice):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, **GREEDY)
    out = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content, streamed, ids, reason = reassemble(chunks)
    message = out.choices[0].message
    assert streamed == calls(message) and reason == out.choices[0].finish_reason
    assert content == (message.content or "")
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_parallel_tool_calls_false_makes_one_call(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, **GREEDY)
    assert len(out.choices[0].message.tool_calls) == 1


def test_a_conversation_with_tool_results(client, engine):
    tools = [G]  # one tool: the conversation fits the tiny model's 512-token context
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                           **GREEDY).choices[0].message
    conversation = MESSAGES + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "ok"} for call in first.tool_calls]
    out = client.chat.completions.create(model=MODEL, messages=conversation, tools=tools, max_tokens=4,
                                         temperature=0)
    prompt = engine.encode(conversation, tools)
    text = engine.tokenizer.decode(prompt)
    assert "<tool_response>\nok\n</tool_response>" in text and text.count("<tool_call>\n{") == \
        len(first.tool_calls) + 1  # the calls made, and the template's example
    assert out.usage.prompt_tokens == len(prompt)


def test_litellm_function_calling(server, client, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price map
    import litellm

    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", **GREEDY)
    out = litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="unused", **kwargs)
    ref = client.chat.completions.create(model=MODEL, **kwargs)
    assert out.choices[0].finish_reason == "tool_calls"
    assert calls(out.choices[0].message) == calls(ref.choices[0].message)
    chunks = list(litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="unused",
                                     stream=True, **kwargs))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert calls(rebuilt.choices[0].message) == calls(ref.choices[0].message)


# ---------------------------------------------------------------------------------------------------- JSON output


def test_json_schema_and_json_object_output(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY, response_format={
        "type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY, stream=True,
                                                   response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert isinstance(json.loads(text), dict)
    completion = client.completions.create(model=MODEL, prompt="x = ", **GREEDY, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_metrics_count_tool_calls_and_grammar_drafts(server, client, engine):
    before, stats_before = metrics(server), {k: vars(v).copy() for k, v in engine.stats.by_source.items()}
    for choice in ("required", NAMED_G):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, **GREEDY)
    after = metrics(server)
    assert delta(after, before, "hybridspec:requests_total", endpoint=CHAT, finish_reason="tool_calls") == 2
    assert "grammar" in engine.stats.by_source  # the tokens the grammar forced were drafted
    for source, counts in engine.stats.by_source.items():
        old = stats_before.get(source, {})
        assert delta(after, before, "hybridspec:spec_decode_num_draft_tokens_total", source=source) == \
            counts.draft_tokens - old.get("draft_tokens", 0), source
        assert delta(after, before, "hybridspec:spec_decode_num_accepted_tokens_total", source=source) == \
            counts.accepted_tokens - old.get("accepted_tokens", 0), source


def test_a_server_without_grammar_drafts_drafts_none_and_answers_the_same(tiny_model, tiny_tokenizer, client):
    """`hybridspec serve --no-grammar-drafts` (server defaults with grammar_drafts=False): the same replies, no
    "grammar" source."""
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer)
    plain = Server(create_app(engine, served_model_name=MODEL, defaults=SERVER_DEFAULTS.replace(grammar_drafts=False)))
    try:
        other = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for choice in ("required", NAMED_G):
            ours = other.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                 **GREEDY)
            theirs = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                    **GREEDY)
            assert calls(ours.choices[0].message) == calls(theirs.choices[0].message)
        assert "grammar" not in engine.stats.by_source and engine.stats.steps > 0
    finally:
        plain.stop()


# ---------------------------------------------------------------------------------------------------- bad input



def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "x"}'}}
BAD = [  # endpoint, body (a dict, or raw bytes), the param the error names
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tool_choice": NAMED_G}, "tool_choice"),
    (CHAT, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT, {"tools": TOOLS, "tool_choice": 5}, "tool_choice"),
    (CHAT, {"tools": TOOLS, "n": 17}, "n"),
    (CHAT, {"tools": [F, F]}, "tools"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    (CHAT, {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
            "tool_choice": "required"}, "tools"),  # xgrammar refuses the schema (the engine's error)
    (CHAT, {"tools": "f"}, "tools"),
    (CHAT, {"messages": MESSAGES + [{"role": "assistant", "tool_calls": [TOOL_CALL]},
                                    {"role": "tool", "content": "ok"}]}, "messages[2].tool_call_id"),
    (CHAT, {"messages": MESSAGES + [{"role": "assistant", "content": None}]}, "messages[1].content"),
    (CHAT, {"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    (CHAT, {"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                                      "arguments": 1}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),  # the engine's error
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_object"}, "tools": TOOLS}, "response_format"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": {"name": "f"}}, "function_call"),
    (COMPLETIONS, {"prompt": "hi", "tools": TOOLS}, "tools"),
    (COMPLETIONS, {"prompt": "hi", "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested_schema(60)}}]},
     "tools"),  # more than 100 levels
    (CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # too deep for Python's json
]


@pytest.mark.parametrize("endpoint, body, param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_tool_and_format_fields_are_a_400_naming_the_field(server, endpoint, body, param):
    if isinstance(body, bytes):
        response = httpx.post(server.url + endpoint, content=body, headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(server.url + endpoint, json={"messages": MESSAGES, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error", error


def test_bad_input_leaves_the_server_serving(server, client):
    for endpoint, body, _ in BAD:
        httpx.post(server.url + endpoint, **({"content": body} if isinstance(body, bytes) else
                                             {"json": {"messages": MESSAGES, "max_tokens": 2, **body}}))
    assert metrics(server)[("hybridspec:num_requests_running", ())] == 0
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         **GREEDY)
    assert out.choices[0].message.tool_calls


# ---------------------------------------------------------------------------------------------------- the contract


class RecordingEngine:
    """Records what the server asks of the engine (the prompt and its `SamplingOptions`) and answers with `deltas`,
    parsed for tool calls as the engine does where the options call tools."""

    class target:
        max_seq_len = 512

    def __init__(self):
        self.deltas, self.finish, self.calls = [], "eos", []

    def submit(self, prompts, options, streamed=False):
        self.calls.append((prompts[0], options))
        return FakeHandle(self.deltas, self.finish, tools=options.call_tools is not None)


@pytest.fixture(scope="module")
def recorded():
    engine = RecordingEngine()
    s = Server(create_app(engine, served_model_name=MODEL))
    yield engine, s
    s.stop()


REPLY = ['Sure.\n<tool', '_call>\n{"name": "f", "arguments": {"a": "</tool_call>"}}\n</tool_call>\n<tool_call>\n',
         '{"name": "g", "argu', 'ments": {"n": 2}}', '\n</tool_call>']


def test_the_engine_gets_the_tool_options_and_messages(recorded):
    engine, server = recorded
    engine.deltas = ["ok"]
    conversation = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL], "name": "bot"},
                               {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    bodies = [({"tools": TOOLS, "tool_choice": NAMED_G, "parallel_tool_calls": False},
               dict(tools=TOOLS, tool_choice=NAMED_G, parallel_tool_calls=False, response_format=None)),
              ({"tools": TOOLS}, dict(tools=TOOLS, tool_choice=None, parallel_tool_calls=True, response_format=None)),
              ({"tool_choice": "auto", "tools": []}, dict(tools=None, tool_choice=None, parallel_tool_calls=True,
                                                          response_format=None)),
              ({"response_format": fmt}, dict(tools=None, tool_choice=None, parallel_tool_calls=True,
                                              response_format=fmt))]
    for body, expected in bodies:
        response = httpx.post(server.url + CHAT, json={"messages": conversation, **body})
        assert response.status_code == 200, response.text
        prompt, options = engine.calls[-1]
        assert {k: getattr(options, k) for k in expected} == expected
    assert prompt == [MESSAGES[0], {"role": "assistant", "tool_calls": [TOOL_CALL], "name": "bot"},
                      {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    httpx.post(server.url + COMPLETIONS, json={"prompt": "x", "response_format": {"type": "json_object"}})
    assert engine.calls[-1][1].response_format == {"type": "json_object"} and engine.calls[-1][1].tools is None


def test_the_server_sends_the_calls_the_engine_parsed(recorded):
    engine, server = recorded
    engine.deltas, engine.finish = REPLY, "eos"
    body = {"messages": MESSAGES, "tools": TOOLS}
    out = httpx.post(server.url + CHAT, json=body).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == "Sure."
    assert calls(out["message"]) == [("f", {"a": "</tool_call>"}), ("g", {"n": 2})]
    events = sse(httpx.post(server.url + CHAT, json={**body, "stream": True}).text.splitlines())
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[1] == {"content": "Sure."}
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert set(deltas[2]["tool_calls"][0]) == {"index", "id", "type", "function"}
    assert deltas[3] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": "</tool_call>"}'}}]}
    assert deltas[-1] == {} and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # tool_choice none: the text as it is; a reply the limit cut after its calls were complete reports them
    out = httpx.post(server.url + CHAT, json={**body, "tool_choice": "none"}).json()["choices"][0]
    assert out["message"] == {"role": "assistant", "content": "".join(REPLY)} and out["finish_reason"] == "stop"
    engine.finish = "length"
    out = httpx.post(server.url + CHAT, json=body).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and len(out["message"]["tool_calls"]) == 2
    engine.deltas = REPLY[:2] + ['{"name": "g", "arguments": {"n": 2}']  # cut inside the last call's end markup
    out = httpx.post(server.url + CHAT, json=body).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and calls(out["message"])[-1] == ("g", {"n": 2})
    engine.deltas = REPLY[:2] + ['{"name": "g", "argu']  # cut before its arguments: text, and the limit
    out = httpx.post(server.url + CHAT, json=body).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and len(out["message"]["tool_calls"]) == 1
    assert out["message"]["content"].endswith('<tool_call>\n{"name": "g", "argu')
    engine.deltas = ['<tool_call>\n{"name": "g", "argu']
    out = httpx.post(server.url + CHAT, json=body).json()["choices"][0]
    assert out["finish_reason"] == "length" and not out["message"].get("tool_calls")


def test_engine_errors_on_tool_fields_name_them():
    class Refusing(RecordingEngine):
        def submit(self, prompts, options, streamed=False):
            raise self.error

    engine = Refusing()
    server = Server(create_app(engine, served_model_name=MODEL))
    try:
        for param in ("tools", "tools[1].function.parameters", "tool_choice", "response_format",
                      "response_format.json_schema", "parallel_tool_calls", "messages[2].tool_call_id"):
            engine.error = InvalidParameter("no", param)
            response = httpx.post(server.url + CHAT, json={"messages": MESSAGES, "tools": TOOLS})
            assert response.status_code == 400 and response.json()["error"]["param"] == param
    finally:
        server.stop()


def test_serve_chat_template_flag(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0 and "--chat-template" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--chat-template: .*no such file"):  # before any model loads
        cli_main(["serve", "--chat-template", str(tmp_path / "missing.jinja")])


# ---------------------------------------------------------------------------------------------------- SmolLM2

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command and see its output.",
                                         "parameters": {"type": "object", "properties": {"command": {
                                             "type": "string", "description": "the command"}},
                                             "required": ["command"]}}}
TASK = [{"role": "system", "content": "You are a coding agent working in a git repository."},
        {"role": "user", "content": "List the Python files in the current directory."}]


@pytest.fixture(scope="module")
def smollm2_client():
    s = Server(create_app(Engine.from_pretrained("smollm2"), served_model_name="smollm2"))
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bash"}}],
                         ids=["required", "named"])
def test_smollm2_calls_the_bash_tool(smollm2_client, choice):
    kwargs = dict(model="smollm2", messages=TASK, tools=[BASH], tool_choice=choice, temperature=0, max_tokens=96)
    out = smollm2_client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls", message
    assert [name for name, _ in calls(message)] == ["bash"] * len(message.tool_calls)
    check_arguments(message, [BASH])
    assert calls(message)[0][1]["command"].strip()
    content, streamed, _, reason = reassemble(smollm2_client.chat.completions.create(**kwargs, stream=True))
    assert streamed == calls(message) and reason == "tool_calls" and content == (message.content or "")


@pytest.mark.slow
def test_smollm2_auto_and_a_second_turn(smollm2_client):
    first = smollm2_client.chat.completions.create(model="smollm2", messages=TASK, tools=[BASH],
                                                   tool_choice="required", temperature=0, max_tokens=96)
    call = first.choices[0].message
    conversation = TASK + [call.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "setup.py\nhello.py"} for c in call.tool_calls]
    out = smollm2_client.chat.completions.create(model="smollm2", messages=conversation, tools=[BASH],
                                                 temperature=0, max_tokens=64)
    message = out.choices[0].message
    assert out.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert message.content or message.tool_calls
    check_arguments(message, [BASH])
    content, streamed, _, reason = reassemble(smollm2_client.chat.completions.create(
        model="smollm2", messages=conversation, tools=[BASH], temperature=0, max_tokens=64, stream=True))
    assert streamed == calls(message) and content == (message.content or "") and \
        reason == out.choices[0].finish_reason

