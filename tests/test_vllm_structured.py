"""vLLM plugin mode under vLLM's own structured outputs (xgrammar): with HYBRIDSPEC_VLLM=suffix and `method: "suffix"`,
greedy outputs constrained by a JSON schema, the two constraints vLLM's server compiles for `tool_choice: "required"`
(a JSON list of calls; the hermes parser's structural tag) and a regex equal vLLM's without speculation, token for
token, at batch 1 and 5; every output is valid against its constraint; our proposer drafted and vLLM accepted some.
The same for the suffix + P-EAGLE hybrid (HYBRIDSPEC_VLLM=hybrid, `method: "eagle3"`), whose router chose drafts of
both sources under the grammar, and for the hybrid with the cost gate on, whose gate learns only the draft tokens the
grammar let through.

Why this holds without anything of the plugin's own: vLLM's scheduler checks every draft against the request's grammar
before scheduling it (`StructuredOutputManager.validate_tokens`: the longest grammar-valid prefix, the matcher rolled
back) and the runner masks the target's logits with a bitmask per draft position, so a draft token outside the grammar
is never verified and the bonus token stays in it. Our proposer's drafts are cut there like vLLM's own; what it sees
next step is only what vLLM committed (`SuffixRequests.update`), so the suffix cache never learns a cut draft.

One vLLM subprocess (four engine starts, ~3-4 minutes here).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_vllm_plugin import (K_PEAGLE, life_cycle, needs_vllm, peagle_for_vllm, read_events,
                              replay_through_fresh_cache, run_vllm)

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 48
K_SUFFIX = 8

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
# What vLLM's OpenAI server constrains a `tool_choice: "required"` reply to where its tool parser has no structural
# tag (tool_parsers/utils.py get_json_schema_from_tools): a list of {name, parameters} objects, one kind per tool
TOOL_CALLS = {"type": "array", "minItems": 1,
              "items": {"type": "object", "anyOf": [{"properties": {"name": {"type": "string", "enum": ["bash"]},
                                                                    "parameters": BASH},
                                                     "required": ["name", "parameters"]}]}}


def _hermes_call(newline: str) -> dict[str, Any]:
    return {"type": "tag", "begin": f'<tool_call>{newline}{{"name": "bash", "arguments": ',
            "content": {"type": "json_schema", "json_schema": BASH, "style": "json", "any_order": False,
                        "max_whitespace_cnt": None, "excludes": []},
            "end": f"}}{newline}</tool_call>"}


# ... and where it has one: what vLLM 0.32's server compiles for the hermes parser, tool_choice "required", a strict
# bash tool and parallel_tool_calls false (structural_tag_registry.get_model_structural_tag, limit_to_single_tool_call)
HERMES_REQUIRED = {"type": "structural_tag", "format": {
    "type": "tags_with_separator", "tags": [_hermes_call("\n"), _hermes_call("")], "separator": "",
    "at_least_one": True, "stop_after_first": True}}
HERMES_BLOCK = re.compile(r"<tool_call>\n?(.*?)\n?</tool_call>", re.DOTALL)
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
TOOL_PROMPT = ("The tests failed with: FileNotFoundError: 'tests/data/config.yaml'. Call the bash tool with the "
               "command `ls -la tests/data` to see what is there.")

# (the user's message, the constraint): "json" a JSON schema, "regex" a regular expression; the messages hold text the
# reply copies (names, paths, commands), so that the suffix method has something to draft from
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Extract the person as JSON with keys name and age. Text: 'Margaret Hamilton, 34, leads the Apollo flight "
     "software team at MIT.'", {"json": PERSON}),
    (TOOL_PROMPT, {"json": TOOL_CALLS}),
    (TOOL_PROMPT, {"structural_tag": json.dumps(HERMES_REQUIRED)}),
    ("Reply with the JSON {\"command\": \"grep -rn parse_config src/\"} and nothing else.", {"json": BASH}),
    ("The release was cut on 2024-03-15 and shipped on 2024-03-18. When did it ship? Answer with the date only.",
     {"regex": DATE}),
]


def structured_worker(model: str, runs: list[dict], out_file: str) -> None:
    """Runs under .venv-vllm/bin/python (hybridspec installed there, no pytest): per run an LLM (its speculative
    config, record directory) generating its batches greedily, each prompt under its structured-outputs constraint;
    writes per run the output token ids and texts of each batch and vLLM's speculative-decoding counters."""
    import json
    import os

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    results = []
    for run in runs:
        if run.get("record"):
            os.environ.update(HYBRIDSPEC_VLLM_OBSERVER="vllm_recorder:Recorder", HYBRIDSPEC_VLLM_RECORD=run["record"])
        else:
            os.environ.pop("HYBRIDSPEC_VLLM_OBSERVER", None)
        os.environ.pop("HYBRIDSPEC_VLLM_VERIFY_COST", None)
        os.environ.update(run.get("env", {}))  # read as the engine (in this process) builds its proposer
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, disable_log_stats=False,
                  speculative_config=run.get("speculative_config"), structured_outputs_config={"backend": "xgrammar"})
        tokens, texts = [], []
        for batch in run["batches"]:
            params = [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"],
                                     structured_outputs=StructuredOutputsParams(**p["constraint"])) for p in batch]
            done = llm.generate([{"prompt_token_ids": p["prompt"]} for p in batch], params, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in done])
            texts.append([o.outputs[0].text for o in done])
        counters = {m.name: m.value for m in llm.get_metrics()
                    if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}
        results.append({"name": run["name"], "tokens": tokens, "texts": texts, "counters": counters})
        del llm
    with open(out_file, "w") as f:
        json.dump(results, f)


def run_structured(runs: list[dict], work: Path, env: dict[str, str], timeout: int = 1200) -> dict[str, dict]:
    return run_vllm(runs, work, env, timeout, worker=structured_worker)


def chat_prompts() -> list[list[int]]:
    from hybridspec.model.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)) for text, _ in CASES]


def valid(text: str, constraint: dict[str, Any]) -> bool:
    """Whether `text` satisfies the constraint: a whole match of the regex, JSON valid against the schema, or (the
    hermes tag) one <tool_call> block calling bash with arguments valid against its parameters."""
    import jsonschema

    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    try:
        if "structural_tag" in constraint:
            blocks = HERMES_BLOCK.findall(text)
            call = json.loads(blocks[0])
            jsonschema.validate(call["arguments"], BASH)
            return len(blocks) == 1 and call["name"] == "bash" and HERMES_BLOCK.sub("", text).strip() == ""
        jsonschema.validate(json.loads(text), constraint["json"])
    except (ValueError, IndexError, KeyError, TypeError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def structured_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_structured")
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS, "constraint": c} for p, (_, c) in zip(chat_prompts(), CASES)]
    batches = [[r] for r in requests] + [requests]  # each alone, then all at once
    peagle = str(peagle_for_vllm(work))
    runs = [{"name": "none", "batches": batches},
            {"name": "suffix", "batches": batches, "record": str(work / "rec-suffix"),
             "speculative_config": {"method": "suffix", "num_speculative_tokens": K_SUFFIX}},
            {"name": "hybrid", "batches": batches, "record": str(work / "rec-hybrid"),
             "speculative_config": {"method": "eagle3", "model": peagle,
                                    "num_speculative_tokens": K_PEAGLE, "parallel_drafting": True}},
            {"name": "hybrid-gate", "batches": batches, "record": str(work / "rec-hybrid-gate"),
             "env": {"HYBRIDSPEC_VLLM_VERIFY_COST": "default"},
             "speculative_config": {"method": "eagle3", "model": peagle,
                                    "num_speculative_tokens": K_PEAGLE, "parallel_drafting": True}}]
    results = run_structured(runs, work, {"HYBRIDSPEC_VLLM": "suffix,hybrid"})
    return SimpleNamespace(work=work, batches=batches, results=results)


@needs_vllm
@pytest.mark.parametrize("method", ["suffix", "hybrid", "hybrid-gate"])
def test_structured_greedy_outputs_of_our_methods_equal_vllm_without_speculation(structured_runs, method):
    plain, ours = structured_runs.results["none"], structured_runs.results[method]
    assert all(len(o) > 0 for batch in plain["tokens"] for o in batch)
    assert ours["tokens"] == plain["tokens"]  # batch 1 (one batch per case) and all together (the last)
    assert ours["texts"] == plain["texts"]


@needs_vllm
def test_every_structured_output_satisfies_its_constraint(structured_runs):
    for name in ("none", "suffix", "hybrid", "hybrid-gate"):
        for batch, texts in zip(structured_runs.batches, structured_runs.results[name]["texts"]):
            for request, text in zip(batch, texts):
                assert valid(text, request["constraint"]), (name, request["constraint"], text)


@needs_vllm
def test_our_proposer_drafted_under_the_grammar_and_vllm_accepted_some(structured_runs):
    counters = structured_runs.results["suffix"]["counters"]
    assert counters.get("vllm:spec_decode_num_drafts", 0) > 0, counters
    assert counters.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, counters
    assert not structured_runs.results["none"]["counters"].get("vllm:spec_decode_num_drafts")
    recordings = read_events(structured_runs.work / "rec-suffix")
    assert len(recordings) == 1
    counts = replay_through_fresh_cache(recordings[0])  # the same drafts as a fresh SuffixCache, step by step
    assert counts["drafts"] > 0
    cycles = life_cycle(recordings[0])
    assert cycles["start"] == sum(len(b) for b in structured_runs.batches) and cycles["restart"] == 0


@needs_vllm
def test_the_hybrid_chose_both_sources_under_the_grammar_and_vllm_accepted_some(structured_runs):
    counters = structured_runs.results["hybrid"]["counters"]
    assert counters.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, counters
    recordings = read_events(structured_runs.work / "rec-hybrid")
    chosen = [e["source"] for recording in recordings for e in recording if e["event"] == "chosen"]
    assert {"suffix", "peagle"} <= set(chosen), sorted(set(chosen))


@needs_vllm
def test_the_gate_learns_only_the_draft_tokens_the_grammar_let_through(structured_runs):
    """With the cost gate on, vLLM's grammar cut drafts the gate had routed (`cut` events: the tokens verified, fewer
    than routed, and never fewer than vLLM then accepted), the path on which the gate keeps only the verified part
    to learn from (what it learns there: test_vllm_plugin's
    test_the_gate_learns_only_from_the_draft_tokens_vllm_verified)."""
    events = read_events(structured_runs.work / "rec-hybrid-gate")[0]
    routed = [e for e in events if e["event"] == "routed" and e["draft"]]
    cuts = [e for e in events if e["event"] == "cut"]
    assert routed and cuts, (len(routed), len(cuts))
    # what vLLM accepted after a cut never exceeds what it verified: the next tokens committed are at most those and
    # the target's own
    verified, checked = {}, 0
    for e in events:
        if e["event"] == "cut":
            verified[e["rid"]] = e["verified"]
        elif e["event"] == "append" and e["rid"] in verified:
            assert len(e["tokens"]) <= verified.pop(e["rid"]) + 1, e
            checked += 1
    assert checked > 0
    replay_through_fresh_cache(events)


def test_the_constraint_check_accepts_and_refuses():
    assert valid('{"name": "Margaret Hamilton", "age": 34}', {"json": PERSON})
    assert not valid('{"name": "Margaret Hamilton", "age": "34"}', {"json": PERSON})
    assert not valid('{"name": "Margaret', {"json": PERSON})
    assert valid('[{"name": "bash", "parameters": {"command": "ls tests/data"}}]', {"json": TOOL_CALLS})
    assert not valid('[{"name": "python", "parameters": {"command": "ls"}}]', {"json": TOOL_CALLS})
    assert not valid("[]", {"json": TOOL_CALLS})
    assert valid("2024-03-18", {"regex": DATE}) and not valid("2024-03-18.", {"regex": DATE})
    tag = {"structural_tag": json.dumps(HERMES_REQUIRED)}
    assert valid('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', tag)
    assert not valid('<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>', tag)
    assert not valid('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call> and more', tag)
