"""Speculation under a grammar on the real SmolLM2-135M-Instruct: for every proposer (the suffix cache, n-gram, each
shipped drafter head, the hybrid; chains and trees) greedy decoding of a tool call (tool_choice required, the shipped
ChatML tools template) and of a JSON-schema answer returns the tokens of plain constrained greedy decoding, and the
answers parse: the call as a `bash` call, the JSON against its schema."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

BASH = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command and see its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
AGENT = [{"role": "system", "content": "You are a coding agent working in a git repository."},
         {"role": "user", "content": "Fix the failing test in tests/test_calc.py. Start by looking at the files."}]
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                           "authors": {"type": "array", "items": {"type": "string"},
                                                                       "maxItems": 3}},
          "required": ["title", "year", "authors"]}
CASES = {
    "tool_call": (AGENT, dict(tools=BASH, tool_choice="required")),
    "json_schema": ([{"role": "user", "content": "Describe a famous physics book as JSON."}],
                    dict(response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}})),
}
PROPOSERS = [("suffix", False), ("ngram", False), ("peagle", False), ("peagle", True), ("fasteagle", False),
             ("lstm", False), ("eagle3", True), ("suffix+peagle", True)]


@pytest.fixture(scope="module")
def engine():
    from hybridspec import Engine

    return Engine.from_pretrained("smollm2")


@pytest.mark.parametrize("case", list(CASES))
def test_every_proposer_decodes_a_grammar_exactly(engine, case):
    jsonschema = pytest.importorskip("jsonschema")
    messages, options = CASES[case]
    reference = engine.generate(messages, max_new_tokens=48, speculate="none", **options)
    if case == "tool_call":
        assert reference.text.startswith('<tool_call>\n{"name": "bash", "arguments": {')
    for speculate, tree in PROPOSERS:
        result = engine.generate(messages, max_new_tokens=48, speculate=speculate, tree=tree, **options)
        assert result.token_ids == reference.token_ids, (speculate, tree)
    # whole answers parse
    long = engine.generate(messages, max_new_tokens=160, speculate="suffix", parallel_tool_calls=False, **options)
    assert long.finish_reason == "eos"
    if case == "tool_call":
        assert [c["function"]["name"] for c in long.tool_calls] == ["bash"]
        assert isinstance(json.loads(long.tool_calls[0]["function"]["arguments"])["command"], str)
    else:
        jsonschema.validate(json.loads(long.text), SCHEMA)
