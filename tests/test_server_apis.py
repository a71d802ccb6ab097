"""The APIs agent clients speak, beside chat completions, on a tiny random Llama over real HTTP with the official SDKs:
OpenAI's Responses API (the `openai` SDK's `responses`), Anthropic's Messages API (the `anthropic` SDK), and chat
completions' `n`, log-probabilities, the developer role and `/v1/models/{id}`. Replies equal what the engine makes of
the same conversation in-process (greedy), whatever the API; tool calls come back as each API's items or blocks.
The real clients on SmolLM2 (Codex CLI, Claude Code, the Agents SDK): tests/test_clients.py."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from hybridspec.model.target import TargetModel
from hybridspec.runtime.engine import Engine
from hybridspec.serve import create_app
from hybridspec.serve.openai_responses import ResponseStore
from test_server import Server, metrics

MODEL = "tiny"
LS = {"type": "object", "properties": {"command": {"type": "string", "enum": ["ls", "pwd"]}}, "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": LS}}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    """A random model with room for a conversation with tools in characters (its tokens)."""
    from hybridspec.tools.testing import tiny_llama

    return Engine(TargetModel(tiny_llama(vocab_size=128, max_position_embeddings=2048)), tiny_tokenizer,
                  verify_cost=None)


@pytest.fixture(scope="module")
def server(engine):
    s = Server(create_app(engine, served_model_name=MODEL, response_store_bytes=1 << 20))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def engine_reply(engine, messages, **options):
    return engine.generate(messages, speculate="none", **{"max_new_tokens": 24, **options})


# ---------------------------------------------------------------------------------------------------- Responses API


def test_a_response_is_the_engines_reply_to_its_instructions_and_input(engine, oai):
    want = engine_reply(engine, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "ls -la"}])
    response = oai.responses.create(model=MODEL, instructions="Be terse.", input="ls -la", max_output_tokens=24,
                                    **GREEDY)
    assert response.output_text == want.text and response.object == "response"
    assert response.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert response.usage.output_tokens == len(want.token_ids)
    assert response.usage.input_tokens == len(want.prompt_token_ids)
    # input items say the same; the developer role is the system's
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
             {"role": "user", "content": "ls -la"}]
    again = oai.responses.create(model=MODEL, input=items, max_output_tokens=24, **GREEDY)
    assert again.output_text == want.text and again.usage.input_tokens_details.cached_tokens > 0


def test_streamed_response_events_add_up_to_the_response(oai):
    kinds, text, done = [], "", None
    for event in oai.responses.create(model=MODEL, input="cat setup.py", max_output_tokens=20, stream=True, **GREEDY):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and done.output_text == text and text
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    whole = oai.responses.create(model=MODEL, input="cat setup.py", max_output_tokens=20, **GREEDY)
    assert whole.output_text == text


def test_function_calls_round_trip_through_the_responses_api(engine, oai, server):
    tools = [{"type": "function", "name": "bash", "parameters": LS},
             {"type": "web_search"}]  # a built-in tool (Codex sends some): not callable here, left out
    first = oai.responses.create(model=MODEL, input="list the files", tools=tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, **GREEDY)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "bash" and json.loads(calls[0].arguments)["command"] in ("ls", "pwd")
    assert first.status == "completed"
    want = engine_reply(engine, [{"role": "user", "content": "list the files"}], tools=CHAT_TOOLS,
                        tool_choice="required", parallel_tool_calls=False, max_new_tokens=120)
    assert [c["function"]["arguments"] for c in want.tool_calls] == [calls[0].arguments]
    # the call's output in a follow-up, by previous_response_id, equals the whole conversation sent again
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.py\nb.py"}
    follow = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=tools,
                                  max_output_tokens=16, **GREEDY)
    replayed = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "list the files"},
                                                        {"type": "function_call", "call_id": calls[0].call_id,
                                                         "name": "bash", "arguments": calls[0].arguments}, output],
                                    tools=tools, max_output_tokens=16, **GREEDY)
    assert follow.output_text == replayed.output_text and follow.previous_response_id == first.id
    # streamed: the call as output_item.added, its arguments in deltas, .done
    kinds, arguments = [], ""
    for event in oai.responses.create(model=MODEL, input="list the files", tools=tools, tool_choice="required",
                                      parallel_tool_calls=False, max_output_tokens=120, stream=True, **GREEDY):
        kinds.append(event.type)
        arguments += event.delta if event.type == "response.function_call_arguments.delta" else ""
    assert "response.function_call_arguments.done" in kinds and arguments == calls[0].arguments
    assert metrics(server)[("hybridspec:requests_total", (("endpoint", "/v1/responses"),
                                                          ("finish_reason", "tool_calls")))] >= 2


def test_stored_responses_are_bounded_retrievable_and_deletable(server, oai):
    response = oai.responses.create(model=MODEL, input="pwd", max_output_tokens=4, **GREEDY)
    assert oai.responses.retrieve(response.id).output_text == response.output_text
    oai.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)
    unstored = oai.responses.create(model=MODEL, input="pwd", max_output_tokens=4, store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="x", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.param == "previous_response_id"
    store = ResponseStore(budget_bytes=600)
    for i in range(5):
        store.put({"id": f"r{i}", "output": "x" * 100}, [{"role": "user", "content": "y" * 100}])
    assert store.get("r0") is None and store.get("r4") is not None and store.nbytes <= 600


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "x", "model": "gpt-5"}, "model"),
])
def test_bad_responses_requests_name_their_field(server, body, param):
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text


# ---------------------------------------------------------------------------------------------------- Messages API


def test_a_message_is_the_engines_reply_and_tool_use_round_trips(engine, claude):
    want = engine_reply(engine, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "ls"}],
                        stop=["\n"])
    reply = claude.messages.create(model=MODEL, max_tokens=24, system="Be terse.", stop_sequences=["\n"],
                                   messages=[{"role": "user", "content": "ls"}], extra_body=GREEDY)
    assert reply.content[0].text == want.text and reply.usage.output_tokens == len(want.token_ids)
    assert reply.stop_reason == {"length": "max_tokens", "stop": "stop_sequence", "eos": "end_turn"}[
        want.finish_reason]
    assert reply.stop_sequence == ("\n" if want.finish_reason == "stop" else None)
    tools = [{"name": "bash", "description": "Run a command.", "input_schema": LS}]
    used = claude.messages.create(model=MODEL, max_tokens=120, tools=tools, extra_body=GREEDY,
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  messages=[{"role": "user", "content": "list the files"}])
    assert used.stop_reason == "tool_use" and [b.type for b in used.content] == ["tool_use"]
    assert used.content[0].name == "bash" and used.content[0].input["command"] in ("ls", "pwd")
    with claude.messages.stream(model=MODEL, max_tokens=120, tools=tools, extra_body=GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "list the files"}]) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == used.content[0].input and streamed.stop_reason == "tool_use"
    # the result of the call, as the next turn sends it
    turn = [{"role": "user", "content": "list the files"}, {"role": "assistant", "content": used.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": used.content[0].id,
                                          "content": [{"type": "text", "text": "a.py"}]}]}]
    after = claude.messages.create(model=MODEL, max_tokens=12, tools=tools, messages=turn, extra_body=GREEDY)
    want = engine_reply(engine, [{"role": "user", "content": "list the files"},
                                 {"role": "assistant", "content": "", "tool_calls": [{
                                     "id": used.content[0].id, "type": "function", "function": {
                                         "name": "bash", "arguments": used.content[0].input}}]},
                                 {"role": "tool", "tool_call_id": used.content[0].id, "content": "a.py"}],
                        tools=[{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                                                 "parameters": LS}}], max_new_tokens=12)
    assert (after.content[0].text if after.content and after.content[0].type == "text" else "") == (want.content or "")


def test_messages_count_tokens_and_errors_in_anthropics_shape(server, claude, engine):
    counted = claude.messages.count_tokens(model=MODEL, system="s", messages=[{"role": "user", "content": "hello"}])
    assert counted.input_tokens == len(engine.encode([{"role": "system", "content": "s"},
                                                      {"role": "user", "content": "hello"}]))
    inline = claude.messages.count_tokens(model=MODEL, messages=[  # Claude Code sends its system prompt so too
        {"role": "system", "content": [{"type": "text", "text": "s"}]}, {"role": "user", "content": "hello"}])
    assert inline.input_tokens == counted.input_tokens
    for body, status in (({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400),
                         ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
                         ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "model": "claude"}, 404)):
        response = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "k"}, timeout=60)
        assert response.status_code == status and response.json()["type"] == "error", response.text
        assert response.json()["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "system", "content": "x"}])


# ---------------------------------------------------------------------------------------------------- chat completed


def test_n_samples_share_one_prompt_and_each_is_the_engines(engine, oai):
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "ls -la"}]
    sampled = dict(temperature=1.0, seed=11, speculate="none")  # what a sample draws depends on the drafts too
    out = oai.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=8, temperature=1.0, seed=11,
                                      extra_body={"speculate": "none"})
    want = engine.generate([messages] * 3, max_new_tokens=8, **sampled)
    assert [c.message.content for c in out.choices] == [w.text for w in want] and [c.index for c in out.choices] == \
        [0, 1, 2]
    assert out.usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert out.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert want[0].stats.prefill_tokens < len(want[0].prompt_token_ids)  # the prompt ran once for the three
    texts = {0: "", 1: ""}
    for chunk in oai.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=1.0, seed=11,
                                             max_tokens=8, stream=True, extra_body={"speculate": "none"}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [w.text for w in engine.generate([messages] * 2, max_new_tokens=8, **sampled)]


def test_logprobs_are_the_targets_whatever_was_drafted(engine, oai, server):
    prompt = [{"role": "user", "content": "ls -la; cat setup.py; ls -la; cat setup.py; ls -la"}]
    plain = engine.generate(prompt, max_new_tokens=16, speculate="none", logprobs=3)
    drafted = engine.generate(prompt, max_new_tokens=16, speculate="suffix", logprobs=3)
    assert drafted.token_ids == plain.token_ids and len(plain.logprobs) == len(plain.token_ids)
    for a, b in zip(plain.logprobs, drafted.logprobs):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and a.top[0][0] == a.token  # greedy: the argmax
    out = oai.chat.completions.create(model=MODEL, messages=prompt, max_tokens=16, logprobs=True, top_logprobs=3,
                                      **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == len(plain.token_ids) and all(len(c.top_logprobs) == 3 for c in content)
    # the same logprobs but for float32 rounding (this call's prompt partly from the prefix cache: other products)
    assert all(abs(c.logprob - lp.logprob) < 1e-4 for c, lp in zip(content, plain.logprobs))
    streamed = [c for chunk in oai.chat.completions.create(model=MODEL, messages=prompt, max_tokens=16,
                                                           logprobs=True, stream=True, **GREEDY)
                for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    text = oai.completions.create(model=MODEL, prompt="ls -la; cat", max_tokens=6, logprobs=2, **GREEDY)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == text.usage.completion_tokens
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0


def test_models_by_id(server):
    assert httpx.get(server.url + "/v1/models/" + MODEL).json()["id"] == MODEL
    missing = httpx.get(server.url + "/v1/models/gpt-5")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
