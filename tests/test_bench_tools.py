"""benchmarks/bench_tools.py: the requests it builds from real agent runs (tool calls from logged actions,
AutoCodeRover's JSON extractions), how replies are compared and checked, the counters, the servers' command lines, the
ratios and targets on stand-ins; then a `--smoke` run of `hybridspec serve` (slow) and a small run against vLLM's
server (vllm)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_vllm_plugin import needs_vllm

import bench_tools
from bench_tools import (ACR_SCHEMA, JSON_BODY, TOOL_BODY, TOOLS, StructuredCall, add_checks, add_ratios, chat_call,
                         chat_template_path, counter_deltas, json_calls, parse_counters, parsed, prompt_ids,
                         reply_output, select_methods, server_command, split_action, targets, tool_calls,
                         tool_messages, tool_targets, valid)
from harness import CallRecord, summarize_runs

MINI = "THOUGHT: list the backends.\n\n```bash\nls -F django/db/backends/\n```"
SWE = "Let's open the file and look.\n\n```\nopen django/db/backends/postgresql/client.py\n```"
CONVERSATION = [
    {"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": MINI}, {"role": "user", "content": "<returncode>0</returncode>\n<output>a/\n"},
    {"role": "assistant", "content": "I will think."}, {"role": "user", "content": "Format error: one block please."},
    {"role": "assistant", "content": SWE}, {"role": "user", "content": "[File: client.py (70 lines total)]"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from hybridspec.model.loading import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def template():
    return chat_template_path().read_text()


def test_an_action_is_the_last_fenced_block_and_the_thought_the_text_before_it():
    assert split_action(MINI) == ("THOUGHT: list the backends.", "ls -F django/db/backends/")
    assert split_action(SWE) == ("Let's open the file and look.", "open django/db/backends/postgresql/client.py")
    edit = "Fix it.\n```\nedit 3:3\n    return x\nend_of_edit\n```\n"
    assert split_action(edit) == ("Fix it.", "edit 3:3\n    return x\nend_of_edit")
    assert split_action("First\n```python\nx = 1\n```\nthen\n```bash\npytest -x\n```") == (
        "First\n```python\nx = 1\n```\nthen", "pytest -x")
    assert split_action("no action here") is None and split_action("```\n\n```") is None


def test_logged_actions_become_bash_tool_calls_answered_by_tool_messages():
    out = tool_messages(CONVERSATION, "call_t")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool"]
    first, second = out[2], out[6]
    assert first["content"] == "THOUGHT: list the backends."
    assert first["tool_calls"] == [{"id": "call_t_0", "type": "function", "function": {
        "name": "bash", "arguments": json.dumps({"command": "ls -F django/db/backends/"})}}]
    assert out[3] == {"role": "tool", "tool_call_id": "call_t_0", "content": CONVERSATION[3]["content"]}
    assert out[4] == CONVERSATION[4] and out[5] == CONVERSATION[5]  # no action: as logged
    assert second["tool_calls"][0]["id"] == "call_t_1" and out[7]["tool_call_id"] == "call_t_1"
    # a later call of the trajectory repeats the earlier one's messages exactly (the servers' prefix caches hit)
    assert tool_messages(CONVERSATION[:4], "call_t") == out[:4]
    # an action without content keeps content None (OpenAI's tool-call message)
    assert tool_messages([{"role": "assistant", "content": "```bash\nls\n```"}])[0]["content"] is None


def test_the_tools_template_renders_the_calls_and_the_tool_results(tokenizer, template):
    text = tokenizer.decode(prompt_ids(tokenizer, template, tool_messages(CONVERSATION, "c"), TOOLS))
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -F django/db/backends/"}}\n</tool_call>' in text
    assert "<tool_response>\n<returncode>0</returncode>" in text and '"name": "bash"' in text.split("</tools>")[0]
    assert text.endswith("<|im_start|>assistant\n")


def test_requests_from_the_real_traces(tokenizer, template):
    trajectories = tool_calls(tokenizer, template, 2, 2, 3072, 64)
    assert [t[0].framework for t in trajectories] == ["SWE-agent", "mini-swe-agent"]
    for calls in trajectories:
        assert [c.workload for c in calls] == ["tools", "tools"] and all(c.body == TOOL_BODY for c in calls)
        assert all(len(c.prompt_token_ids) <= 3072 and c.max_tokens == 64 for c in calls)
        later = calls[1].messages
        assert later[:len(calls[0].messages)] == calls[0].messages  # consecutive calls of one conversation
        assert any(m.get("tool_calls") for m in later) and any(m["role"] == "tool" for m in later)
    extractions = json_calls(tokenizer, template, 2, 3072, 160)
    assert len({json.dumps(c.messages) for c in extractions}) == 2 and len({c.trajectory for c in extractions}) == 2
    for c in extractions:
        assert c.framework == "AutoCodeRover" and c.workload == "json" and c.body == JSON_BODY
        assert "into json format" in c.messages[0]["content"] and c.max_tokens == 160
    with pytest.raises(ValueError, match="only 0 .* fit in 10 prompt tokens"):
        json_calls(tokenizer, template, 1, 10, 160)


TOOL_CALL = StructuredCall("t", 0, [], [1], "tools", TOOL_BODY)
JSON_CALL = StructuredCall("j", 0, [], [1], "json", JSON_BODY)


def test_replies_compared_as_sent_as_parsed_and_checked_against_their_request():
    ours = reply_output(None, [("bash", '{"command": "ls"}')])
    theirs = reply_output("", [("bash", '{"command":  "ls"}')])  # vLLM: content "", other whitespace
    assert ours != theirs and parsed(ours) == parsed(theirs) == [["bash", {"command": "ls"}]]
    assert reply_output("", [("bash", '{"command": "ls"}')]) == ours  # "" beside calls is no content
    assert valid(TOOL_CALL, ours) and not valid(TOOL_CALL, reply_output(None, []))
    assert not valid(TOOL_CALL, reply_output(None, [("python", '{"command": "ls"}')]))
    assert not valid(TOOL_CALL, reply_output(None, [("bash", '{"cmd": "ls"}')]))
    assert not valid(TOOL_CALL, reply_output(None, [("bash", '{"command": "ls"')]))
    good = {"API_calls": ['search_class("Foo")'], "bug_locations": [{"file": "a.py", "method": "f"}]}
    assert valid(JSON_CALL, reply_output(json.dumps(good), []))
    assert parsed(reply_output(json.dumps(good, indent=2), [])) == good
    too_many = dict(good, API_calls=["a()"] * (ACR_SCHEMA["properties"]["API_calls"]["maxItems"] + 1))
    assert not valid(JSON_CALL, reply_output(json.dumps(too_many), []))
    assert not valid(JSON_CALL, reply_output('{"API_calls": [', [])) and parsed(reply_output("{", [])) == "{"


def test_a_call_sends_its_body_and_records_the_reply():
    sent = {}

    def create(**kwargs):
        sent.update(kwargs)
        call = SimpleNamespace(function=SimpleNamespace(name="bash", arguments='{"command": "ls"}'))
        message = SimpleNamespace(content=None, tool_calls=[call])
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="tool_calls")],
                               usage=SimpleNamespace(prompt_tokens=1, completion_tokens=9))

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    r = chat_call(client, "serve-suffix", TOOL_CALL)
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    assert sent["temperature"] == 0 and sent["max_tokens"] == 64 and "stream" not in sent
    assert (r.new_tokens, r.server_prompt_tokens, r.finish_reason) == (9, 1, "tool_calls")
    assert parsed(r.output) == [["bash", {"command": "ls"}]] and r.workload == "tools"


def test_counters_keep_hybridspecs_sources():
    page = "\n".join([
        '# TYPE hybridspec:spec_decode_num_draft_tokens counter',
        'hybridspec:spec_decode_num_draft_tokens_total{source="suffix"} 30.0',
        'hybridspec:spec_decode_num_draft_tokens_total{source="grammar"} 12.0',
        'hybridspec:spec_decode_num_draft_tokens_created{source="grammar"} 1.7e9',
        'hybridspec:spec_decode_num_accepted_tokens_total{source="suffix"} 20.0',
        'hybridspec:spec_decode_num_accepted_tokens_total{source="grammar"} 12.0',
        'hybridspec:spec_decode_num_drafts_total{source="suffix"} 8.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 64.0', "vllm:num_requests_running 1.0"])
    counters = parse_counters(page)
    assert counters == {"spec_decode_num_draft_tokens": 42.0, "spec_decode_num_draft_tokens[suffix]": 30.0,
                        "spec_decode_num_draft_tokens[grammar]": 12.0, "spec_decode_num_accepted_tokens": 32.0,
                        "spec_decode_num_accepted_tokens[suffix]": 20.0,
                        "spec_decode_num_accepted_tokens[grammar]": 12.0, "spec_decode_num_drafts": 8.0,
                        "spec_decode_num_drafts[suffix]": 8.0, "generation_tokens": 64.0}
    deltas = counter_deltas({"spec_decode_num_draft_tokens": 2.0}, counters)
    assert deltas["spec_decode_num_draft_tokens"] == 40 and deltas["acceptance"] == 0.8
    assert deltas["accepted_per_draft"] == 4.0


def test_methods_and_server_command_lines(tmp_path):
    assert select_methods("vllm-suffix,serve-none") == ["serve-none", "vllm-suffix"]
    assert select_methods("vllm-none", no_vllm=True) == []
    with pytest.raises(ValueError, match="unknown method 'suffix'"):
        select_methods("suffix")
    template = tmp_path / "t.jinja"
    argv, env = server_command(bench_tools.METHODS["vllm-ngram"], "smollm2", tmp_path, 8000, 1, template)
    joined = " ".join(argv)
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in joined and f"--chat-template {template}" in joined
    assert '"method": "ngram"' in joined and "HYBRIDSPEC_VLLM" not in env  # vLLM's own methods
    assert json.loads(argv[argv.index("--structured-outputs-config") + 1]) == {"backend": "xgrammar"}
    argv, _ = server_command(bench_tools.METHODS["serve-suffix-nogrammar"], "smollm2", tmp_path, 8000, 1, template)
    assert argv[argv.index("--speculate") + 1] == "suffix" and "--no-grammar-drafts" in argv
    assert argv[argv.index("--chat-template") + 1] == str(template)
    argv, _ = server_command(bench_tools.METHODS["serve-suffix"], "smollm2", tmp_path, 8000, 1, template)
    assert "--no-grammar-drafts" not in argv


def test_checks_ratios_and_targets():
    calls = {("t", 0): TOOL_CALL, ("j", 0): JSON_CALL}
    call_ls = reply_output(None, [("bash", '{"command": "ls"}')])
    extraction = reply_output('{"API_calls": [], "bug_locations": []}', [])
    outputs = {"serve-none": (call_ls, extraction), "serve-suffix": (call_ls, extraction),
               "serve-suffix-nogrammar": (call_ls, extraction),
               "vllm-suffix": (reply_output("", [("bash", '{"command":"ls"}')]), reply_output('{"API_calls": [', [])),
               "vllm-none": (call_ls, extraction)}
    seconds = {"serve-none": 2.0, "serve-suffix": 1.0, "serve-suffix-nogrammar": 1.25, "vllm-suffix": 1.6,
               "vllm-none": 2.5}

    def rec(method, key, output):
        return CallRecord(method, calls[key].workload, key[0], key[1], 1, 10, output, seconds[method], None)

    runs = {m: [rec(m, ("t", 0), o[0]), rec(m, ("j", 0), o[1])] for m, o in outputs.items()}
    reference = {r.key: r.output for r in runs["serve-none"]}
    tables = summarize_runs(runs, reference)
    add_checks(tables, runs, calls, reference)
    for table in tables.values():
        add_ratios(table)
    overall = tables["overall"]
    assert overall["vllm-suffix"]["identical_calls"] == 0 and overall["vllm-suffix"]["same_calls"] == 1
    assert overall["vllm-suffix"]["valid_calls"] == 1 and overall["serve-suffix"]["valid_calls"] == 2
    assert tables["tools"]["vllm-suffix"]["same_calls"] == 1 and tables["json"]["vllm-suffix"]["same_calls"] == 0
    assert overall["serve-suffix"]["vs_none"] == 2.0 and overall["serve-suffix"]["vs_best_vllm"] == 1.6
    goals = targets({1: overall})
    assert goals["serve_suffix_vs_none@1"] == {"ratio": 2.0, "target": 1.5, "pass": True, "identical": True}
    assert goals["serve_suffix_vs_nogrammar@1"]["ratio"] == 1.25
    best = goals["serve_suffix_vs_best_vllm@1"]
    assert best["best_vllm"] == "vllm-suffix" and best["target"] == 1.3 and best["pass"] == (best["ratio"] >= 1.3)
    assert overall["serve-suffix"]["tokens_per_call"] == 10
    tools = dict(tables["tools"], **{"serve-suffix-spaced": {**tables["tools"]["serve-suffix"], "tokens_per_call": 14},
                                     "serve-suffix-messages": {**tables["tools"]["serve-suffix"], "tok_s": 9.9}})
    replies = {"serve-suffix": {"tokens_per_call": 50}, "serve-suffix-spaced": {"tokens_per_call": 60}}
    goals = tool_targets(tools, replies)
    assert goals["spaced_tokens_per_call_vs_compact@1[tools]"] == {"ratio": 1.4, "target": 1.3, "pass": True}
    assert goals["spaced_tokens_per_call_vs_compact@1[json]"] == {"ratio": 1.2, "target": 1.3, "pass": False}
    assert goals["messages_vs_chat@1"]["ratio"] == round(9.9 / tables["tools"]["serve-suffix"]["tok_s"], 3)


@pytest.mark.slow
def test_a_smoke_run_of_hybridspec_serve_with_tools_and_a_json_schema(tmp_path, capsys):
    if not bench_tools.HYBRIDSPEC_CLI.exists():
        pytest.skip("no .venv/bin/hybridspec")
    out = tmp_path / "bench_tools.json"
    assert bench_tools.main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["not_run"] == {} and result["outputs_compared"] == "tool_calls"
    assert set(result["workloads"]) == {"overall", "tools", "json"}
    level = result["workloads"]["overall"]["concurrency-1"]
    assert set(level) == {"serve-none", "serve-suffix", "serve-suffix-responses", "serve-suffix-messages"}
    for name, s in level.items():
        calls = 2 if name == "serve-suffix-messages" else 3  # Anthropic's API: the tool calls only
        assert s["calls"] == calls and s["tok_s"] > 0 and s["prompt_token_mismatches"] == 0, name
        assert s["identical_calls"] == s["same_calls"] == calls, name  # exact under the grammar, through any API
        assert s["vs_none"] is not None and s["vs_best_vllm"] is None
    tools = result["workloads"]["tools"]["concurrency-1"]["serve-suffix"]
    assert tools["valid_calls"] == 2, result["replies"]  # every reply calls bash with a command
    server = level["serve-suffix"]["server"]
    assert server["generation_tokens"] == level["serve-suffix"]["new_tokens"]
    assert server.get("spec_decode_num_draft_tokens[grammar]", 0) > 0  # the grammar's forced tokens were drafted
    assert {"serve_suffix_vs_none@1", "responses_vs_chat@1", "messages_vs_chat@1"} <= set(result["targets"])
    assert "serve-suffix" in capsys.readouterr().out


@needs_vllm
def test_a_small_run_against_vllms_server_with_its_structured_outputs(tmp_path):
    """vLLM's server takes the same requests (tools rendered by the same template: the same prompt tokens) and
    constrains them: its calls are valid and the same as ours once parsed; its suffix method drafted."""
    out = tmp_path / "bench_tools.json"
    assert bench_tools.main(["--methods", "serve-none,vllm-suffix", "--trajectories", "1", "--calls-per-trajectory",
                             "2", "--json-calls", "1", "--json-max-tokens", "24", "--concurrency", "1", "--json",
                             str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["not_run"] == {}, result["not_run"]
    level = result["workloads"]["overall"]["concurrency-1"]
    vllm = level["vllm-suffix"]
    assert vllm["prompt_token_mismatches"] == 0 and vllm["calls"] == 3
    tools = result["workloads"]["tools"]["concurrency-1"]["vllm-suffix"]
    assert tools["valid_calls"] == tools["same_calls"] == 2, result["replies"]
    assert vllm["server"]["spec_decode_num_drafts"] > 0 and vllm["vs_best_vllm"] == 1.0
