"""`hybridspec serve` on a tiny random Llama, over real HTTP (uvicorn in a thread on a free loopback port): the
official `openai` client and raw httpx, streaming and not, chat and text completions. Greedy outputs over HTTP equal
`Engine.generate`'s for the same request; concurrent requests each get what they would get alone; a client that
goes away mid-stream is cancelled; bad input gets OpenAI's error JSON with a 400 naming the field, and the server
lives on; /metrics agrees exactly with the usage the responses returned and with the engine's own counters.
The real-model run with an unmodified agent framework: tests/test_server_agent.py."""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hybridspec.cli import main as cli_main
from hybridspec.errors import ContextLengthExceeded, InvalidParameter, InvalidParameterType
from hybridspec.runtime.engine import Engine
from hybridspec.serve import create_app
from hybridspec.serve.protocol import CHAT_ONLY, REQUEST_FIELDS, UNSUPPORTED
from hybridspec.model.target import TargetModel

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "ls -la; cat setup.py"}]


class Server:
    """uvicorn serving `app` in a daemon thread on 127.0.0.1 and a free port."""

    def __init__(self, app):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()


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
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[tuple, float]:
    """/metrics parsed: {(sample name, sorted label items): value}."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def openai_reason(engine_reason: str) -> str:
    return "length" if engine_reason == "length" else "stop"  # "eos" and "stop" (a stop string) are both "stop"


def sse(lines) -> list[dict]:
    """The `data:` payloads of an SSE body, checking that it ends with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---------------------------------------------------------------------------------------------------- endpoints


def test_health_models_and_cli(server, capsys):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 512
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0 and "--served-model-name" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--prefill-chunk must be positive"):  # before any model loads
        cli_main(["serve", "--prefill-chunk", "0"])
    with pytest.raises(SystemExit, match="--default-temperature: temperature"):
        cli_main(["serve", "--default-temperature", "-1"])


def test_chat_greedy_equals_engine(client, engine):
    ref = engine.generate(MESSAGES, max_new_tokens=40, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == openai_reason(ref.finish_reason)
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.object == "chat.completion" and out.model == MODEL
    # the prefix cache holds the KV of the reference call: the same prompt again is a hit
    assert out.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_equals_engine(client, engine):
    ref = engine.generate(MESSAGES, max_new_tokens=60, temperature=0, speculate="none")
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text and len(chunks) > 3  # deltas, not one block
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [openai_reason(ref.finish_reason)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_content_parts_and_stop_string(client, engine):
    ref = engine.generate(MESSAGES, max_new_tokens=40, temperature=0)
    stop = ref.text[10:12]
    stopped = engine.generate(MESSAGES, max_new_tokens=40, temperature=0, stop=stop)
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": MESSAGES[1]["content"]}]}]
    out = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=40, temperature=0, stop=[stop])
    assert out.choices[0].message.content == stopped.text and out.choices[0].finish_reason == "stop"


def test_completions(server, client, engine, tiny_tokenizer):
    prompt = "def fib(n):\n    return"
    ref = engine.generate(prompt, max_new_tokens=30, temperature=0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    assert out.choices[0].text == ref.text and out.object == "text_completion"
    assert out.usage.completion_tokens == len(ref.token_ids)
    raw = httpx.post(server.url + "/v1/completions", content=json.dumps(  # no JSON Content-Type, as curl -d
        {"prompt": prompt, "max_tokens": 30, "temperature": 0}), headers={"Content-Type": "text/plain"})
    assert raw.status_code == 200 and raw.json()["choices"][0]["text"] == ref.text
    ids = tiny_tokenizer.encode(prompt)
    streamed = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == ref.text
    assert streamed[-1].choices[0].finish_reason == openai_reason(ref.finish_reason)


def test_sampling_with_seed_equals_engine(client, engine):
    """seed reproduces a sample where the draws do not depend on the drafts: without speculation. (With it, the
    distribution is the target's but a draw depends on what the suffix cache has seen.)"""
    options = dict(temperature=0.8, top_p=0.9, seed=7, speculate="none")
    ref = engine.generate(MESSAGES, max_new_tokens=30, **options).text
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0.8, top_p=0.9)
    texts = [client.chat.completions.create(**kwargs, seed=seed, extra_body={"speculate": "none"}).choices[0]
             .message.content for seed in (7, 7, 8)]
    assert texts[0] == texts[1] == ref != texts[2]


def test_concurrent_requests_each_get_their_own_output(client, engine):
    prompts = [[{"role": "user", "content": f"task {i}: " + "abc " * i}] for i in range(6)]
    refs = [engine.generate(p, max_new_tokens=48, temperature=0).text for p in prompts]

    def ask(i):
        kwargs = dict(model=MODEL, messages=prompts[i], max_tokens=48, temperature=0)
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kwargs) if c.choices)
        return client.chat.completions.create(**kwargs).choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(ask, range(6))) == refs


def test_client_gone_mid_stream_is_cancelled(server, engine):
    long = [{"role": "user", "content": "count to 29"}]  # the tiny model's greedy answer runs past 450 tokens
    assert engine.generate(long, max_new_tokens=450, temperature=0).finish_reason == "length"
    before, new_before = metrics(server), engine.stats.new_tokens
    body = {"model": MODEL, "messages": long, "max_tokens": 450, "temperature": 0, "stream": True,
            "speculate": "none"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line)
        assert next(lines).startswith("data: ")  # the role chunk
        assert json.loads(next(lines)[len("data: "):])["choices"][0]["delta"]["content"]
    # the connection is closed: the request leaves the engine at its next step
    deadline = time.monotonic() + 20
    while True:
        after = metrics(server)
        if delta(after, before, "hybridspec:requests_total", endpoint="/v1/chat/completions",
                 finish_reason="abort") == 1 and after[("hybridspec:num_requests_running", ())] == 0:
            break
        assert time.monotonic() < deadline, "the abandoned stream was not cancelled"
        time.sleep(0.05)
    assert engine.stats.new_tokens - new_before < 450  # it stopped early, not at max_tokens
    assert delta(after, before, "hybridspec:generation_tokens_total") == 0
    # the server and engine go on
    out = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 8}).json()
    assert out["usage"]["completion_tokens"] == 8


class FakeHandle:
    """What the server reads of an engine call (`RequestHandle`): its deltas, each text with the tool-call events the
    engine's parser makes of it (with tools), then its result; `error` is raised after the deltas, as a call whose
    proposer or target failed."""

    def __init__(self, deltas: list[str], finish: str = "eos", tools: bool = False, error: Exception | None = None):
        from hybridspec.grammar.tool_calls import ToolCallStreamParser, collect
        from hybridspec.runtime.handle import Delta

        parser = ToolCallStreamParser() if tools else None
        self._outputs = [Delta(0, d, parser.feed(d) if parser else []) for d in deltas]
        if parser is not None:
            self._outputs.append(Delta(0, "", parser.finish()))
        content, calls = collect(e for d in self._outputs for e in d.events) if tools else (None, None)
        self._final, self._error = Result("".join(deltas), finish, content, calls), error
        self.results, self.cancelled = None, False

    @property
    def result(self):
        return self.results[0] if self.results else None

    async def outputs(self):
        for output in self._outputs:
            yield output
        if self._error is not None:
            raise self._error
        self.results = [self._final]

    def cancel(self):
        self.cancelled = True


class Result:
    def __init__(self, text: str, finish: str, content: str | None = None, tool_calls: list | None = None):
        from hybridspec.runtime.stats import GenerationStats

        self.text, self.finish_reason, self.content, self.tool_calls = text, finish, content, tool_calls
        self.token_ids, self.prompt_token_ids, self.stats = list(text), [0], GenerationStats()
        self.logprobs, self.stop = None, None


class BrokenEngine:
    def submit(self, prompts, options, streamed=False):
        return FakeHandle(["a"], error=RuntimeError("the target fell over"))


def test_engine_failure_is_reported_and_the_server_goes_on():
    server = Server(create_app(BrokenEngine(), served_model_name=MODEL))
    try:
        body = {"messages": USER, "max_tokens": 5}
        response = httpx.post(server.url + CHAT, json=body)
        assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
        assert "the target fell over" in response.json()["error"]["message"]
        events = sse(httpx.post(server.url + CHAT, json={**body, "stream": True}).text.splitlines())
        assert events[1]["choices"][0]["delta"] == {"content": "a"}
        assert "the target fell over" in events[-1]["error"]["message"]
        after = metrics(server)
        assert after[("hybridspec:requests_total", (("endpoint", CHAT), ("finish_reason", "error")))] == 2
        assert after[("hybridspec:num_requests_running", ())] == 0
        assert after[("hybridspec:http_requests_total", (("endpoint", CHAT), ("status", "500")))] == 1
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------- bad input

LONG = "x" * 600  # the tiny model's context is 512 tokens, one per character
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [  # endpoint, body (a dict, or raw bytes), the param the error names, its HTTP status
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content", 400),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", 400),
    (CHAT, {"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", 400),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", 400),
    (CHAT, {"messages": [USER[0], {"role": "robot", "content": "hi"}]}, "messages[1].role", 400),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role", 400),
    (CHAT, {}, "messages", 400),
    (CHAT, {"messages": []}, "messages", 400),
    (CHAT, {"messages": "hi"}, "messages", 400),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages", 400),
    (CHAT, {"messages": USER, "stream": True, "max_tokens": 4, "temperature": 0,
            "user": "someone", "stop": [""]}, "stop", 400),
    (CHAT, {"messages": [{"role": "user", "content": LONG}], "stream": True}, "messages", 400),
    (CHAT, {"messages": USER, "temperature": -0.5}, "temperature", 400),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature", 400),
    (CHAT, {"messages": USER, "top_p": 0}, "top_p", 400),
    (CHAT, {"messages": USER, "top_p": 1.5}, "top_p", 400),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens", 400),
    (CHAT, {"messages": USER, "max_tokens": -3}, "max_tokens", 400),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", 400),
    (CHAT, {"messages": USER, "n": 17}, "n", 400),
    (CHAT, {"messages": USER, "n": 0}, "n", 400),
    (CHAT, {"messages": USER, "speculate": "telepathy"}, "speculate", 400),
    (CHAT, {"messages": USER, "speculate": "peagle"}, "speculate", 400),  # the shipped head is SmolLM2's
    (COMPLETIONS, {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs", 400),  # without logprobs: true
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),
    (CHAT, {"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty", 400),
    (CHAT, {"messages": USER, "model": "gpt-4"}, "model", 404),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}', None, 400),
    (CHAT, b"[1, 2]", None, 400),
    (COMPLETIONS, {}, "prompt", 400),
    (COMPLETIONS, {"prompt": ""}, "prompt", 400),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", 400),
    (COMPLETIONS, {"prompt": [5, 99999]}, "prompt", 400),
    (COMPLETIONS, {"prompt": LONG}, "prompt", 400),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, "echo", 400),
    (COMPLETIONS, {"prompt": "hi", "n": 30, "stream": True}, "n", 400),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", 400),
]


@pytest.mark.parametrize("endpoint, body, param, status", BAD,
                         ids=[f"{'chat' if e == CHAT else 'text'}-{p}-{i}" for i, (e, _, p, _) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, endpoint, body, param, status):
    if isinstance(body, bytes):
        response = httpx.post(server.url + endpoint, content=body, headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(server.url + endpoint, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert set(error) == {"message", "type", "param", "code"}
    if isinstance(body, dict) and body.get("messages", body.get("prompt")) in ([{"role": "user", "content": LONG}],
                                                                                 LONG):
        assert error["code"] == "context_length_exceeded"


def test_bad_input_leaves_the_server_serving(server, client):
    before = metrics(server)
    for endpoint, body, _, status in BAD:
        response = httpx.post(server.url + endpoint, **({"content": body} if isinstance(body, bytes) else
                                                         {"json": body}))
        assert response.status_code == status
    with pytest.raises(openai.BadRequestError) as e:  # what the official client makes of it
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert e.value.status_code == 400 and "messages[0].role" in str(e.value)
    after = metrics(server)
    assert delta(after, before, "hybridspec:http_requests_total", endpoint=CHAT, status="400") == \
        sum(1 for e, _, _, s in BAD if e == CHAT and s == 400) + 1
    assert delta(after, before, "hybridspec:http_requests_total", endpoint=CHAT, status="500") == 0
    assert after[("hybridspec:num_requests_running", ())] == 0
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
    assert out.usage.completion_tokens <= 5


REFUSED = {"best_of": 3, "frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"5": 1},
           "functions": [{"name": "f"}], "function_call": {"name": "f"}, "echo": True,
           "suffix": "}",  # a value UNSUPPORTED refuses, per field; and CHAT_ONLY's on text completions:
           "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_each_unsupported_field_is_a_400_naming_it(server, endpoint):
    refused = {**UNSUPPORTED, **(CHAT_ONLY if endpoint == COMPLETIONS else {})}
    assert set(REFUSED) == set(UNSUPPORTED) | set(CHAT_ONLY)
    base = {"messages": USER} if endpoint == CHAT else {"prompt": "hi"}
    for field, value in ((f, v) for f, v in REFUSED.items() if f in refused):
        response = httpx.post(server.url + endpoint, json={**base, "max_tokens": 2, field: value})
        assert response.status_code == 400, (field, response.text)
        error = response.json()["error"]
        assert error["param"] == field and "not supported" in error["message"], error
    # the values that change nothing are accepted, each field at once
    accepted = {field: allowed[-1] for field, (allowed, _) in refused.items()}
    response = httpx.post(server.url + endpoint, json={**base, "max_tokens": 2, **accepted})
    assert response.status_code == 200, response.text


class RefusingEngine:
    """Raises `error` for every call, as the engine does for a bad parameter (before any step)."""

    error: Exception = ValueError()

    class target:
        max_seq_len = 64

    def submit(self, prompts, options, streamed=False):
        raise self.error


def test_engine_errors_name_the_field_by_their_param_not_their_text():
    """Messages that mention no field (or another one) still get the param the error carries."""
    engine = RefusingEngine()
    server = Server(create_app(engine, served_model_name=MODEL))
    expected = [(InvalidParameter("no", "prompt"), CHAT, "messages", None),
                (InvalidParameter("no", "prompt"), COMPLETIONS, "prompt", None),
                (ContextLengthExceeded("too much", "prompt"), CHAT, "messages", "context_length_exceeded"),
                (ContextLengthExceeded("too much", "prompt"), COMPLETIONS, "prompt", "context_length_exceeded"),
                (InvalidParameter("temperature is fine", "messages[3].content"), CHAT, "messages[3].content", None),
                (InvalidParameterType("bad kind", "speculate"), CHAT, "speculate", None),
                (InvalidParameter("seed and stop", "tree"), CHAT, None, None),  # no request field sets it
                *[(InvalidParameter("the context", name), endpoint, field, None)
                  for name, field in REQUEST_FIELDS.items() for endpoint in (CHAT, COMPLETIONS)]]
    try:
        for error, endpoint, param, code in expected:
            engine.error = error
            body = {"messages": USER} if endpoint == CHAT else {"prompt": "hi"}
            response = httpx.post(server.url + endpoint, json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"] == {"message": str(error), "type": "invalid_request_error",
                                                "param": param, "code": code}
        engine.error = InvalidParameter("no", "max_new_tokens")
        response = httpx.post(server.url + CHAT, json={"messages": USER, "max_completion_tokens": 3})
        assert response.json()["error"]["param"] == "max_completion_tokens"  # the field the limit came from
        engine.error = ValueError("temperature must be >= 0")  # untyped: the server's fault, whatever it says
        response = httpx.post(server.url + CHAT, json={"messages": USER})
        assert response.status_code == 500 and response.json()["error"]["param"] is None
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------- metrics


def test_metrics_agree_with_usage_and_engine(server, client, engine):
    before, stats_before = metrics(server), _engine_counts(engine)
    usages = {CHAT: [], COMPLETIONS: []}
    conversation = list(MESSAGES)
    for turn in range(3):  # an agent's calls: each re-sends the conversation so far (prefix-cache hits)
        out = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=24, temperature=0)
        usages[CHAT].append((out.usage, out.choices[0].finish_reason))
        conversation += [{"role": "assistant", "content": out.choices[0].message.content},
                         {"role": "user", "content": f"observation {turn}: " + "ok " * 5}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"speculate": "ngram"}))
    usages[CHAT].append((chunks[-1].usage, next(c.choices[0].finish_reason for c in chunks
                                                 if c.choices and c.choices[0].finish_reason)))
    for speculate in ("suffix", "none"):
        out = client.completions.create(model=MODEL, prompt="abcabcabc", max_tokens=12, temperature=0,
                                        extra_body={"speculate": speculate})
        usages[COMPLETIONS].append((out.usage, out.choices[0].finish_reason))
    after, stats_after = metrics(server), _engine_counts(engine)

    every = usages[CHAT] + usages[COMPLETIONS]
    assert sum(u.prompt_tokens_details.cached_tokens for u, _ in usages[CHAT][1:]) > 0
    for name, field in (("prompt_tokens", "prompt_tokens"), ("generation_tokens", "completion_tokens")):
        assert delta(after, before, f"hybridspec:{name}_total") == sum(getattr(u, field) for u, _ in every)
    assert delta(after, before, "hybridspec:prefix_cache_hit_tokens_total") == \
        sum(u.prompt_tokens_details.cached_tokens for u, _ in every)
    for endpoint, calls in usages.items():
        for reason in ("stop", "length"):
            assert delta(after, before, "hybridspec:requests_total", endpoint=endpoint, finish_reason=reason) == \
                sum(1 for _, r in calls if r == reason)
        assert delta(after, before, "hybridspec:http_requests_total", endpoint=endpoint, status="200") == len(calls)
    assert delta(after, before, "hybridspec:time_to_first_token_seconds_count") == len(every)
    assert delta(after, before, "hybridspec:inter_token_latency_seconds_count") == \
        sum(u.completion_tokens - 1 for u, _ in every)
    # the speculative counters are the engine's own, per source
    assert delta(after, before, "hybridspec:decode_steps_total") == stats_after["steps"] - stats_before["steps"]
    sources = set(stats_after["by_source"])
    assert {"suffix", "ngram"} <= sources
    for source in sources:
        new, old = stats_after["by_source"][source], stats_before["by_source"].get(source, {})
        for metric, field in (("steps_won", "won"), ("drafts", "drafts"), ("draft_tokens", "draft_tokens"),
                              ("accepted_tokens", "accepted_tokens")):
            assert delta(after, before, f"hybridspec:spec_decode_num_{metric}_total", source=source) == \
                new[field] - old.get(field, 0), (source, metric)
    assert delta(after, before, "hybridspec:spec_decode_num_draft_tokens_total", source="suffix") > 0
    # the target's passes by kind: every call here ran prompt tokens, and decoded alone after them
    for kind in ("prompt", "decode"):
        seconds = delta(after, before, f"hybridspec:{kind}_pass_seconds_total")
        assert seconds > 0 and seconds == pytest.approx(stats_after[f"{kind}_s"] - stats_before[f"{kind}_s"])
    assert stats_after["decode_passes"] - stats_before["decode_passes"] > 0


def _engine_counts(engine) -> dict:
    s = engine.stats
    return {"steps": s.steps, "by_source": {name: vars(src).copy() for name, src in s.by_source.items()},
            **vars(engine.passes)}
