"""Tool calls in text (`hybridspec.grammar.tool_calls`) and chat prompts with tools (`hybridspec.runtime.prompts`):
the parse of whole texts (examples, and generated content + calls recovered exactly), the streaming parser's events
adding up to the whole parse for any split of the text, the ChatML tools template's rendering, and the choice of
template."""
from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.errors import InvalidParameter
from hybridspec.grammar.tool_calls import (TOOL_CALL_BEGIN, TOOL_CALL_END, ToolCallStreamParser, collect,
                                           parse_tool_calls)
from hybridspec.runtime.prompts import (check_messages, encode_prompt, ignores_tools, load_chat_template,
                                        tools_template)
from hybridspec.tools.testing import TINY_CHAT_TEMPLATE, tiny_tokenizer


def block(name: str, arguments, raw: str | None = None) -> str:
    body = raw if raw is not None else json.dumps({"name": name, "arguments": arguments})
    return f"{TOOL_CALL_BEGIN}\n{body}\n{TOOL_CALL_END}"


def calls_of(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


# ---------------------------------------------------------------------------------------------------- whole texts


def test_calls_and_content():
    ls = block("bash", {"command": "ls -la"})
    assert calls_of(ls) == (None, [("bash", {"command": "ls -la"})])
    assert calls_of("Let me look.\n" + ls + "\n" + block("read", {"path": "a.py"}) + "\n") == \
        ("Let me look.", [("bash", {"command": "ls -la"}), ("read", {"path": "a.py"})])
    assert calls_of("  just text \n") == ("just text", [])
    assert calls_of("") == (None, []) and calls_of(" \n\t") == (None, [])
    assert calls_of("a " + ls + " b " + ls + " c") == ("a  b  c", [("bash", {"command": "ls -la"})] * 2)
    # no arguments: {}; arguments as a JSON string: taken as sent
    assert calls_of(block("", None, raw='{"name": "now"}')) == (None, [("now", {})])
    content, calls = parse_tool_calls(block("", None, raw='{"name": "f", "arguments": "{\\"a\\": 1}"}'))
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_openai_shape_and_unique_ids():
    _, calls = parse_tool_calls(block("f", {"x": "é"}) * 3)
    assert [set(c) for c in calls] == [{"id", "type", "function"}] * 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 3
    assert calls[0]["function"]["arguments"] == '{"x": "é"}'  # JSON, not ASCII-escaped (as OpenAI sends it)


@pytest.mark.parametrize("text", [
    block("", None, raw="{not json}"),
    block("", None, raw='{"arguments": {"a": 1}}'),  # no name
    block("", None, raw='{"name": "", "arguments": {}}'),
    block("", None, raw='{"name": 5, "arguments": {}}'),
    block("", None, raw='{"name": "f", "arguments": [1, 2]}'),
    block("", None, raw='{"name": "f", "arguments": "not json"}'),
    block("", None, raw='["f"]'),
    TOOL_CALL_BEGIN + '\n{"name": "f", "arguments": {"a": ',  # cut mid-call (length)
    TOOL_CALL_BEGIN + "[" * 5000 + "]" * 5000 + TOOL_CALL_END,  # too deep for json: content, not a RecursionError
])
def test_a_block_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls("Hi. " + text) == (("Hi. " + text).strip(), [])


def test_block_boundaries():
    # the end tag inside a JSON string is part of the argument
    args = {"command": 'echo "</tool_call>" \\ <tool_call>'}
    assert calls_of(block("bash", args)) == (None, [("bash", args)])
    # a call cut before its end tag (a stop string) is a call if its JSON is complete
    assert calls_of('ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n') == ("ok", [("f", {"a": 1})])
    # a partial tag at the end, or text that only looks like one, is content
    assert calls_of("if a < b: <tool_c") == ("if a < b: <tool_c", [])
    assert calls_of("</tool_call> <tool_cal> x") == ("</tool_call> <tool_cal> x", [])
    # a bad block keeps everything to its end tag; the next block is parsed on its own
    assert calls_of("<tool_call>oops</tool_call>" + block("f", {})) == ("<tool_call>oops</tool_call>", [("f", {})])


# ---------------------------------------------------------------------------------------------------- streaming

FRAGMENTS = st.sampled_from([
    "Let me check. ", " ", "\n", "\t", "a < b", "<", "<tool", "_call>", "</tool_call>", "<tool_call>", '"', "\\",
    '{"name": "bash", "arguments": {"command": "ls"}}', '{"name": "f"}', '{"name": ', '"x", "arguments": {}}', "}",
    '"</tool_call>"', "{not json}", block("bash", {"command": "cat </tool_call> | wc"}), block("f", {"a": [1, 2]}),
    block("g", None, raw='{"name": "g", "arguments": "{\\"k\\": \\"v\\"}"}'),
])


def streamed(text: str, cuts: list[int]) -> list:
    parser = ToolCallStreamParser(counter_ids())
    bounds = [0, *sorted(set(cuts)), len(text)]
    events = [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])]
    return events + parser.finish()


@settings(max_examples=400, deadline=None)
@given(st.lists(FRAGMENTS, max_size=12).map("".join).flatmap(
    lambda text: st.tuples(st.just(text), st.lists(st.integers(0, len(text)), max_size=12))))
def test_streamed_events_add_up_to_the_whole_parse_for_any_split(text_and_cuts):
    text, cuts = text_and_cuts
    events = streamed(text, cuts)
    assert collect(events) == parse_tool_calls(text, counter_ids())
    # OpenAI's shape: each call's id, type and name first (arguments ""), then its argument fragments, in order
    seen = -1
    for event in events:
        if isinstance(event, str):
            assert event
        elif "id" in event:
            assert event["index"] == seen + 1 and event["type"] == "function" and event["function"]["arguments"] == ""
            seen += 1
        else:
            assert event["index"] == seen and set(event["function"]) == {"arguments"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.text(st.sampled_from(list("ab <>/_\"\\{}:\n\t")), max_size=12),
    st.tuples(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8),
              st.dictionaries(st.text(max_size=5), st.one_of(st.text(max_size=12), st.integers(), st.booleans(),
                                                               st.lists(st.integers(), max_size=3)), max_size=3))),
    max_size=8), st.data())
def test_generated_calls_are_recovered_exactly(segments, data):
    texts = ["".join(s for s in segments[:i + 1] if isinstance(s, str)) for i in range(len(segments))]
    text = "".join(s if isinstance(s, str) else block(*s) for s in segments)
    content = "".join(s for s in segments if isinstance(s, str))
    # content text that holds a tag of its own is another test's business
    if TOOL_CALL_BEGIN in content or any(t.endswith(tuple(TOOL_CALL_BEGIN[:n] for n in range(1, 11))) for t in texts):
        return
    expected = (content.strip() or None, [(name, args) for name, args in (s for s in segments if isinstance(s, tuple))])
    assert calls_of(text) == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert collect(streamed(text, cuts)) == parse_tool_calls(text, counter_ids())


def test_text_is_sent_as_soon_as_it_cannot_start_a_call():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello") == ["Hello"]
    assert parser.feed(" <tool") == []  # maybe a call; the space waits for more content
    assert parser.feed("box> x") == [" <toolbox> x"]
    assert parser.feed("\n<tool_call>\n{\"name\": \"f\", ") == []
    events = parser.feed('"arguments": {}}\n</tool_call>\n')
    assert [e["function"] for e in events] == [{"name": "f", "arguments": ""}, {"arguments": "{}"}]
    assert parser.finish() == [] and parser.calls == 1


# ---------------------------------------------------------------------------------------------------- prompts

BASH = [{"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
TOOL_CALLS = [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
              {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}}]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "where am I?"},
                {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS},
                {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
                {"role": "tool", "tool_call_id": "c2", "content": "/tmp"}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(128)


def render(tokenizer, messages, tools=None, chat_template=None) -> str:
    return tokenizer.decode(encode_prompt(tokenizer, messages, 128, 4096, tools=tools, chat_template=chat_template))


def test_tools_template_renders_tools_calls_and_responses(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=BASH, chat_template=tools_template(), tokenize=False,
                                         add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\nYou can call these tools:\n<tools>\n"
        + json.dumps(BASH[0]["function"]) + "\n</tools>\nTo call tools, answer with one block per call:\n"
        '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments>}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nwhere am I?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\n/tmp\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    # the calls as the model writes them: a history parses back to its calls
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert calls_of(reply) == (None, [("bash", {"command": "ls"}), ("bash", {"command": "pwd"})])


def test_tools_fall_back_to_the_shipped_template_where_the_own_ignores_them(tokenizer):
    def shipped(messages, tools):
        return tokenizer.apply_chat_template(check_messages(messages), tools=tools, chat_template=tools_template(),
                                             tokenize=True, add_generation_prompt=True, return_dict=False)

    assert ignores_tools(tokenizer)  # the tiny ChatML template, as SmolLM2's
    ids = encode_prompt(tokenizer, CONVERSATION, 128, 4096, tools=BASH)
    assert ids == shipped(CONVERSATION, BASH)
    # a history with tool calls needs it even when the request sends no tools
    assert encode_prompt(tokenizer, CONVERSATION, 128, 4096) == shipped(CONVERSATION, None)
    # without either the tokenizer's own template renders (a plain conversation is unchanged)
    plain = [{"role": "user", "content": "hi"}]
    assert render(tokenizer, plain) == tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def test_a_given_template_or_one_that_renders_tools_is_kept(tokenizer):
    own = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{{ (tools or []) | length }} tools"
    assert render(tokenizer, [{"role": "user", "content": "hi"}], BASH, chat_template=own) == "user:hi;1 tools"
    assert render(tokenizer, [{"role": "user", "content": "hi"}], BASH, chat_template=TINY_CHAT_TEMPLATE) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # asked for: rendered, tools or not
    renders_tools = tiny_tokenizer(128)
    renders_tools.chat_template = own
    assert not ignores_tools(renders_tools)
    assert renders_tools.decode(encode_prompt(renders_tools, [{"role": "user", "content": "x"}], 128, 4096,
                                              tools=BASH)) == "user:x;1 tools"


def test_check_messages_tool_fields():
    checked = check_messages(CONVERSATION)
    assert checked[2]["content"] == "" and [c["function"]["arguments"] for c in checked[2]["tool_calls"]] == \
        [{"command": "ls"}, {"command": "pwd"}]  # JSON strings parsed, as vLLM does
    bad = [
        (CONVERSATION[:3] + [{"role": "tool", "content": "a.py"}], "messages[3].tool_call_id"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "messages[1].content"),
        ([{"role": "user", "content": "hi", "tool_calls": TOOL_CALLS}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
         "messages[0].tool_calls[0].function.name"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
         "messages[0].tool_calls[0].function.arguments"),
        ([{"role": "assistant", "tool_calls": "ls"}], "messages[0].tool_calls"),
    ]
    for messages, param in bad:
        with pytest.raises(InvalidParameter) as e:
            check_messages(messages)
        assert e.value.param == param, messages
    # a text-based agent's observation (no tool calls in the conversation) needs no id
    assert check_messages([{"role": "user", "content": "hi"}, {"role": "tool", "content": "out"}])[1]["role"] == "tool"


def test_a_template_that_refuses_the_messages_is_a_bad_parameter(tokenizer):
    refusing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidParameter, match="roles must alternate") as e:
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}], 128, 4096, chat_template=refusing)
    assert e.value.param == "messages"


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TINY_CHAT_TEMPLATE)
    assert load_chat_template(path) == load_chat_template(str(path)) == TINY_CHAT_TEMPLATE
    assert load_chat_template(TINY_CHAT_TEMPLATE) == TINY_CHAT_TEMPLATE
    assert "<tools>" in tools_template()
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(tmp_path / "missing.jinja")
