"""What a careless or hostile client can do to `hybridspec serve` (a tiny random Llama, uvicorn in a thread): a call
whose client leaves is cancelled, streamed or not, running or waiting; what one request may cost is bounded (its
body's bytes, its prompt's length before tokenizing, its grammar's size and compile time, each schema compiled once);
a client's mistake is never a 500 (invalid Unicode, unsatisfiable or unsupported schemas, absurd numbers: a 400 naming
the field, in words of our own), checked by a property test over request bodies; an API key guards /v1 and /metrics.
The long mixed run: tests/test_soak.py."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridspec.model.target import TargetModel
from hybridspec.runtime.engine import Engine
from hybridspec.serve import create_app

from test_server import MODEL, Server, delta, metrics

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
USER = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "count to 29"}]  # the tiny model's greedy answer runs past 450 tokens


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    return Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None)


@pytest.fixture(scope="module")
def server(engine):
    s = Server(create_app(engine, served_model_name=MODEL))
    yield s
    s.stop()


def settle(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ clients that leave


@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES, MESSAGES])
def test_a_non_streamed_call_whose_client_leaves_is_cancelled(server, engine, endpoint, monkeypatch):
    assert engine.generate(LONG, max_new_tokens=450, temperature=0).finish_reason == "length"
    step, steps = engine.loop.run_step, []
    monkeypatch.setattr(engine.loop, "run_step",  # 450 steps: > 2 s
                        lambda plan: steps.append(1) or time.sleep(0.005) or step(plan))
    body = {"model": MODEL, "temperature": 0, "speculate": "none"}
    body.update({CHAT: {"messages": LONG, "max_tokens": 450}, RESPONSES: {"input": LONG, "max_output_tokens": 450},
                 MESSAGES: {"messages": LONG, "max_tokens": 450}}[endpoint])
    before, tokens_before = metrics(server), engine.stats.new_tokens
    with pytest.raises(httpx.ReadTimeout):  # as the openai SDK's timeout leaves it, before retrying
        httpx.post(server.url + endpoint, json=body, timeout=httpx.Timeout(30, read=0.3))
    left, ran = time.monotonic(), len(steps)
    settle(lambda: engine.admission.running == 0)
    stopped_s, after_leaving = time.monotonic() - left, len(steps) - ran
    after = metrics(server)
    assert delta(after, before, "hybridspec:requests_total", endpoint=endpoint, finish_reason="abort") == 1
    assert engine.stats.new_tokens - tokens_before < 450 and stopped_s < 5  # stopped long before its end
    assert after_leaving <= 2, after_leaving  # here 0; the step in flight, and one a loaded machine may race
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_waiting_call_whose_client_leaves_leaves_the_line(tiny_model, tiny_tokenizer):
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, max_num_seqs=1)
    step = engine.loop.run_step
    # the first call runs for 450 steps of 30 ms at least: still running while the second waits, then leaves
    engine.loop.run_step = lambda plan: time.sleep(0.03) or step(plan)
    server = Server(create_app(engine, served_model_name=MODEL))
    try:
        body = {"model": MODEL, "messages": LONG, "max_tokens": 450, "temperature": 0, "speculate": "none"}
        with httpx.stream("POST", server.url + CHAT, json={**body, "stream": True}, timeout=30) as running:
            next(running.iter_lines())  # under way: the next request waits for its place
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + CHAT, json=body, timeout=httpx.Timeout(30, read=0.5))
            settle(lambda: engine.admission.waiting == 0)
            assert engine.admission.running == 1  # the first goes on
        settle(lambda: engine.admission.running == 0)
        assert engine.stats.calls == 2  # the first (cancelled when its stream closed), and this one's check
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------- bounded request cost


def test_a_body_over_the_limit_is_refused_unread_and_memory_stays(engine):
    server = Server(create_app(engine, served_model_name=MODEL, max_body_bytes=1 << 20))
    try:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
        response = httpx.post(server.url + CHAT, content=big, headers={"Content-Type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        chunked = httpx.post(server.url + CHAT, content=iter([big[:1 << 19]] * 4))  # no Content-Length
        assert chunked.status_code == 413
        anthropic = httpx.post(server.url + MESSAGES, content=big)
        assert anthropic.status_code == 413 and anthropic.json()["error"]["type"] == "request_too_large"
    finally:
        server.stop()


def test_a_client_that_leaves_while_sending_its_body_costs_no_500(server):
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    before = metrics(server)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"messages\": [")
        time.sleep(0.2)  # the server is reading the body when the client goes
    settle(lambda: delta(metrics(server), before, "hybridspec:http_requests_total", endpoint=CHAT,
                         status="499") == 1)
    assert delta(metrics(server), before, "hybridspec:http_requests_total", endpoint=CHAT, status="500") == 0
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(server, engine, monkeypatch):
    encoded = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: encoded.append(1) or encode(*a, **k))
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (12 << 20)}]}).encode()  # under 16 MB
    started = time.monotonic()
    response = httpx.post(server.url + CHAT, content=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in response.json()["error"]["message"] and not encoded
    assert time.monotonic() - started < 10
    too_big = httpx.post(server.url + CHAT, content=b"{" + b" " * (40 << 20) + b"}")  # 40 MB: unread
    assert too_big.status_code == 413  # the server's memory after it: tests/test_soak.py (a server of its own)


@pytest.mark.parametrize("prompt, error, param", [
    (5, "InvalidParameterType", "prompt"), (None, "InvalidParameterType", "prompt"),
    ([1] * 100_000, "ContextLengthExceeded", "prompt"), ("x" * 10**7, "ContextLengthExceeded", "prompt"),
    ("a\ud800", "InvalidParameter", "prompt"),
    ([{"role": "user", "content": "\udfff"}], "InvalidParameter", "messages[0].content"),
], ids=["int", "none", "ids", "text", "surrogate", "message"])
def test_the_python_api_refuses_the_same_prompts_by_name(engine, monkeypatch, prompt, error, param):
    from hybridspec.errors import InvalidParameter

    encoded = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: encoded.append(1) or encode(*a, **k))
    with pytest.raises(InvalidParameter) as e:
        engine.generate(prompt, max_new_tokens=2)
    assert type(e.value).__name__ == error and e.value.param == param and not encoded


def test_the_python_api_refuses_a_tool_with_invalid_unicode(engine):
    from hybridspec.errors import InvalidParameter

    tool = {"type": "function", "function": {"name": "f", "description": "\ud800", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidParameter) as e:
        engine.generate(USER, max_new_tokens=2, tools=[tool])
    assert e.value.param == "tools"


def test_grammars_are_bounded_in_size_and_time_and_compiled_once(server, engine, monkeypatch):
    enum = {"type": "object", "properties": {"x": {"enum": [f"value{i}" for i in range(100_000)]}}}
    started = time.monotonic()
    response = httpx.post(server.url + CHAT, json={"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "e", "schema": enum}}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    assert "bytes" in response.json()["error"]["message"] and time.monotonic() - started < 5
    compiles = []
    compile_ = engine.grammars._compile
    monkeypatch.setattr(engine.grammars, "_compile", lambda *a: compiles.append(1) or compile_(*a))
    schema = {"type": "object", "properties": {"n": {"enum": [f"v{i}" for i in range(3000)]}}, "required": ["n"]}
    request = {"messages": USER, "max_tokens": 12, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    monkeypatch.setattr(engine.grammars, "timeout_s", 1e-4)
    slow = httpx.post(server.url + CHAT, json=request)
    assert slow.status_code == 400 and "to compile" in slow.json()["error"]["message"]
    monkeypatch.setattr(engine.grammars, "timeout_s", 30.0)
    first, second = (httpx.post(server.url + CHAT, json=request) for _ in range(2))
    assert first.status_code == second.status_code == 200 and len(compiles) == 1  # the timed-out compile finished
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]


# --------------------------------------------------------------------------------------- a client's mistake: a 400

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
MISTAKES = [  # endpoint, body, the param the 400 names
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "a\udfffb"}], "stream": True}, "messages[0].content"),
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
     "tools[0].function.description"),
    (CHAT, {"messages": USER, "stop": ["\ud800"]}, "stop[0]"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"$ref": "#"}}}}, "response_format"),
    (CHAT, {"messages": USER, "stream": True, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": LOOP}}}, "response_format"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "string", "pattern": "(a|aa)*b{1000}"}}}}, "response_format"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "string", "pattern": "[a-"}}}}, "response_format"),
    # a pattern of one character no token writes (the property test below found it): the mask lets <unk> through
    (CHAT, {"messages": USER, "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "string", "pattern": "\u202e"}}}}, "response_format"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}], "tool_choice": "required"},
     "tools"),
    (CHAT, {"messages": USER, "max_tokens": 10**30}, "max_tokens"),
    (CHAT, {"messages": USER, "seed": 10**30}, "seed"),
    (RESPONSES, {"input": "\ud800"}, "input"),
    (MESSAGES, {"max_tokens": 5, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
]


@pytest.mark.parametrize("endpoint, body, param", MISTAKES, ids=[f"{e.split('/')[-1]}-{p}-{i}" for i, (e, _, p)
                                                                     in enumerate(MISTAKES)])
def test_a_clients_mistake_is_a_400_in_our_words(server, endpoint, body, param):
    response = httpx.post(server.url + endpoint, content=json.dumps({"model": MODEL, **body}),
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    message = error["message"]
    assert ".cc:" not in message and "Check failed" not in message and "Traceback" not in message
    if endpoint != MESSAGES:
        assert error["param"] == param, message
    assert httpx.get(server.url + "/health").status_code == 200


FIELDS = {  # every endpoint's fields, each drawn from values of the right shape and of every wrong one
    CHAT: ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
           "stream", "stream_options", "response_format", "tools", "tool_choice", "parallel_tool_calls", "logprobs",
           "top_logprobs", "speculate", "ignore_eos", "user"],
    COMPLETIONS: ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "logprobs", "echo", "seed"],
    RESPONSES: ["input", "instructions", "max_output_tokens", "temperature", "tools", "tool_choice", "text", "stream",
                "previous_response_id", "store", "parallel_tool_calls"],
    MESSAGES: ["messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences", "temperature", "top_k",
               "stream", "metadata"],
}
HOSTILE_TEXT = st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "x" * 5000, "<tool_call>", "}{", "\u202e",
                                "{{ raise_exception('x') }}", "null"]) | st.text(max_size=20)
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(0, 4)
           | st.floats(allow_nan=True, allow_infinity=True) | HOSTILE_TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(HOSTILE_TEXT | st.sampled_from(["role", "content", "type", "name", "function",
                                                                      "parameters", "schema", "json_schema"]),
                                      inner, max_size=4), max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"]),
                                 "content": HOSTILE_TEXT | JSON})
SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                                    "array", "x"])})
    | st.just({"$ref": "#"}) | st.fixed_dictionaries({"pattern": HOSTILE_TEXT, "type": st.just("string")})
    | st.fixed_dictionaries({"enum": st.lists(SCALARS, max_size=4)}) | JSON,
    lambda inner: st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        HOSTILE_TEXT, inner, max_size=3)}, optional={"required": st.lists(HOSTILE_TEXT, max_size=2)})
    | st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                            optional={"minItems": st.integers(-2, 3), "maxItems": st.integers(-2, 3)})
    | st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}), max_leaves=8)
FUNCTION = st.fixed_dictionaries({"name": st.just("f") | HOSTILE_TEXT},
                                 optional={"description": HOSTILE_TEXT, "parameters": SCHEMA, "strict": JSON})
VALUES = {
    "messages": st.lists(MESSAGE, min_size=1, max_size=3) | JSON,
    "input": st.lists(MESSAGE, min_size=1, max_size=3) | HOSTILE_TEXT | JSON,
    "prompt": HOSTILE_TEXT | JSON,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}), max_size=2)
    | st.lists(FUNCTION.map(lambda f: {"type": "function", **f}), max_size=2)  # the Responses API's flat tools
    | st.lists(st.fixed_dictionaries({"name": st.just("f") | HOSTILE_TEXT, "input_schema": SCHEMA}), max_size=2)
    | JSON,
    "tool_choice": st.sampled_from(["auto", "required", "none", "any", {"type": "function", "function": {
        "name": "f"}}, {"type": "any"}, {"type": "tool", "name": "f"}]) | JSON,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "text", "x"]),
                                              "json_schema": st.fixed_dictionaries({"name": HOSTILE_TEXT,
                                                                                    "schema": SCHEMA})}) | JSON,
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries({
        "type": st.sampled_from(["json_schema", "json_object", "text"]), "name": HOSTILE_TEXT,
        "schema": SCHEMA})}) | JSON,
    "stop": st.lists(HOSTILE_TEXT, max_size=3) | JSON, "stop_sequences": st.lists(HOSTILE_TEXT, max_size=3) | JSON,
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | JSON,
    "max_tokens": st.integers(-2, 8) | JSON, "max_output_tokens": st.integers(-2, 8) | JSON,
    "max_completion_tokens": st.integers(-2, 8) | JSON, "n": st.integers(-1, 3) | JSON,
    "logprobs": st.booleans() | st.integers(-1, 21) | JSON, "top_logprobs": st.integers(-1, 21) | JSON,
}
BASE = {CHAT: {"messages": USER}, COMPLETIONS: {"prompt": "hi"}, RESPONSES: {"input": "hi"},
        MESSAGES: {"messages": USER}}


@st.composite
def request_bodies(draw):
    """A valid request of an endpoint with up to three of its fields drawn, each of any shape or value."""
    endpoint = draw(st.sampled_from(sorted(FIELDS)))
    fields = draw(st.lists(st.sampled_from(FIELDS[endpoint]), unique=True, max_size=3))
    body = {"model": MODEL, **BASE[endpoint], **{f: draw(VALUES.get(f, JSON)) for f in fields}}
    for limit in ("max_tokens", "max_output_tokens", "max_completion_tokens"):  # a valid request stays short
        if limit in body and isinstance(body[limit], int) and not isinstance(body[limit], bool):
            body[limit] = min(body[limit], 8)
    body.setdefault("max_output_tokens" if endpoint == RESPONSES else "max_tokens", 8)
    return endpoint, body


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=request_bodies())
def test_no_request_body_gets_a_500(server, request):
    endpoint, body = request
    text = json.dumps(body)  # NaN and Infinity too, as Python's json writes (and reads) them
    response = httpx.post(server.url + endpoint, content=text, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code < 500, (endpoint, text[:500], response.text[:500])
    if response.status_code >= 400:
        assert response.json()["type" if endpoint == MESSAGES else "error"], response.text
    assert "server_error" not in response.text and "api_error" not in response.text, response.text[:500]


# -------------------------------------------------------------------------------------------------------- API key


def test_an_api_key_guards_v1_and_metrics_not_health(engine):
    server = Server(create_app(engine, served_model_name=MODEL, api_key="sesame"))
    try:
        url = server.url
        assert httpx.get(url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            refused = httpx.get(url + path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(url + path, headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "sesame"}).status_code == 200
        message = httpx.post(url + MESSAGES, json={"max_tokens": 2, "messages": USER})
        assert message.status_code == 401 and message.json()["error"]["type"] == "authentication_error"
        chat = httpx.post(url + CHAT, json={"messages": USER, "max_tokens": 2},
                          headers={"Authorization": "Bearer sesame"})
        assert chat.status_code == 200
        assert metrics_with_key(url)[("hybridspec:http_requests_total", (("endpoint", "/v1/models"),
                                                                         ("status", "401")))] == 2
    finally:
        server.stop()


def metrics_with_key(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sesame"}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_cli_takes_the_key_from_the_environment(monkeypatch):
    import argparse

    from hybridspec.serve import register

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        return parser.parse_args(argv)

    monkeypatch.setenv("HYBRIDSPEC_API_KEY", "from-env")
    assert parse(["serve"]).api_key == "from-env"
    given_ = parse(["serve", "--api-key", "given", "--max-body-size", "2M"])
    assert given_.api_key == "given" and given_.max_body_size == 2 << 20
    monkeypatch.delenv("HYBRIDSPEC_API_KEY")
    assert parse(["serve"]).api_key is None
