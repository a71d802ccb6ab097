"""One options object (`SamplingOptions`): checked when made, frozen, one name per option across the Python API and
the server (whose request bodies convert with `to_options`, errors naming the request's own fields through one
table); and the contract pieces a step passes between router and grammar (`Proposal.subset`, a plain-function
router's kept nodes)."""
from __future__ import annotations

import dataclasses

import pytest

from hybridspec.errors import InvalidParameter
from hybridspec.proposal import Proposal
from hybridspec.router import FunctionRouter
from hybridspec.runtime.options import DEFAULT_OPTIONS, OPTION_NAMES, SamplingOptions, make_options
from hybridspec.serve.app import SERVER_DEFAULTS
from hybridspec.serve.protocol import REQUEST_FIELDS, ChatCompletionRequest, CompletionRequest

BASH = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.mark.parametrize("options, param", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"), ({"speculate": "eagle"}, "speculate"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"), ({"tree": "yes"}, "tree"),
    ({"stop": ["a", ""]}, "stop"), ({"seed": 1.5}, "seed"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "tools": BASH}, "response_format"),
    ({"ignore_eos": True, "tools": BASH}, "ignore_eos"),
])
def test_options_are_checked_when_made_and_name_the_option(options, param):
    with pytest.raises(InvalidParameter) as e:
        SamplingOptions(**options)
    assert e.value.param == param
    with pytest.raises(InvalidParameter) as e:  # the same through overrides of other options
        DEFAULT_OPTIONS.replace(**options)
    assert e.value.param == param


def test_options_are_frozen_normalised_once_and_overridden_by_name():
    options = SamplingOptions(stop="\n", temperature=1, tools=BASH)
    assert options.stop == ("\n",) and options.temperature == 1.0 and isinstance(options.temperature, float)
    assert options.grammar is not None and options.grammar.kind == "tools" and options.call_tools[0]["function"][
        "name"] == "bash"
    assert options.tools is BASH  # rendered by the chat template as given
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temperature = 0.5
    greedy = options.replace(temperature=0, tool_choice="none")
    assert greedy.greedy and greedy.call_tools is None and greedy.stop == ("\n",) and not options.greedy
    assert options.replace() is options
    with pytest.raises(TypeError, match="unexpected arguments: temprature"):
        options.replace(temprature=0)
    with pytest.raises(TypeError):
        make_options({"temperature": 0}, {})  # options are a SamplingOptions, overrides keywords
    assert make_options(None, {"max_new_tokens": 9}).max_new_tokens == 9
    assert make_options(options, {"seed": 3}, DEFAULT_OPTIONS).tools is BASH


def test_the_tools_are_checked_once_per_call(monkeypatch):
    from hybridspec.runtime import options as options_module

    checks = []
    check = options_module.check_tools
    monkeypatch.setattr(options_module, "check_tools", lambda *a: checks.append(1) or check(*a))
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": BASH,
                                                 "temperature": 0})
    body.to_options(SERVER_DEFAULTS)
    assert len(checks) == 1


def test_a_request_converts_to_options_over_the_server_defaults_by_one_table():
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7, "max_tokens": 99, "top_k": -1,
        "stop": "x", "seed": 4, "speculate": "ngram", "tools": BASH, "tool_choice": "required",
        "parallel_tool_calls": False, "ignore_eos": True})
    with pytest.raises(InvalidParameter) as e:  # named by the request's field
        chat.to_options(SERVER_DEFAULTS)
    assert chat.request_field(e.value.param, "messages") == "ignore_eos"
    chat.ignore_eos = None
    options = chat.to_options(SERVER_DEFAULTS)
    assert (options.max_new_tokens, options.top_k, options.stop, options.seed, options.speculate) == \
        (7, 0, ("x",), 4, "ngram")
    assert options.tool_choice == "required" and options.parallel_tool_calls is False
    assert options.temperature == SERVER_DEFAULTS.temperature == 1.0  # OpenAI's default where a request sets none
    text = CompletionRequest.model_validate({"prompt": "hi"}).to_options(SERVER_DEFAULTS)
    assert text == SERVER_DEFAULTS and text.max_new_tokens == 1024
    # every option a request sets has its field in the one table, and every field in it is an option
    assert set(chat.option_values()) <= set(REQUEST_FIELDS) <= OPTION_NAMES
    assert chat.request_field("max_new_tokens", "messages") == "max_completion_tokens"
    assert CompletionRequest.model_validate({"prompt": "x"}).request_field("max_new_tokens", "prompt") == "max_tokens"
    assert chat.request_field("tools[0].function.parameters", "messages") == "tools[0].function.parameters"
    assert chat.request_field("prompt", "messages") == "messages" and chat.request_field("tree", "messages") is None


def test_a_subset_keeps_what_its_nodes_were_and_a_function_router_maps_its_drafts_to_nodes():
    tree = Proposal([5, 6, 7, 8], [-1, 0, 0, 2], [0.9, 0.5, 0.4, 0.3], 2.1, "peagle", drafter_ran=True)
    sub = tree.subset([0, 2, 3])
    assert (sub.token_ids, sub.parents, sub.probs, sub.source, sub.drafter_ran) == \
        ([5, 7, 8], [-1, 0, 1], [0.9, 0.4, 0.3], "peagle", True)
    assert sub.score == pytest.approx(1.6) and tree.subset([0, 1, 2, 3]) is tree
    assert Proposal.chain([1, 2], probs=None).subset([0]).score == 1.0
    assert len(tree.subset([])) == 0
    router = FunctionRouter(lambda proposals, contexts: [p.subset([0, 2]) for p in proposals])
    route = router.plan([tree, tree], [10, 10])
    assert route.keep == [[0, 2], [0, 2]] and route.load is None
    assert route.drafts([tree])[0].token_ids == [5, 7]
    wrong = FunctionRouter(lambda proposals, contexts: [Proposal.chain([9]) for _ in proposals])
    with pytest.raises(ValueError, match="not a subtree"):
        wrong.plan([tree], [10])
