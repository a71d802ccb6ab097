"""Agent-trace replay: loaders (real traces and bad input), message-wise tokenisation and its cache, the oracle replay
against a brute-force simulation, the cost model, and the `hybridspec replay` command."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hybridspec.router import VerifyCost

from hybridspec.agent_traces import (Call, ChatPieces, TokenizedCall, TokenizedTrajectory, TraceFormatError,
                                     TraceTokenizer, Trajectory, UnknownFormatError, detect_format,
                                     load_source, load_traces, replay, session_links, write_jsonl)
from hybridspec.agent_traces.replay import ProposerSpec
from hybridspec.proposal import Proposal

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "agent_traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"development traces not at {TRACES}")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ------------------------------------------------------------------------------------------------------ fixtures

def _conversation(turns: int, seed: int = 0) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    words = ["def", "class", "return", " self", "open", "file", "(", ")", ":", "\n", "    ", "edit", "ls -la", "x = 1",
             "the", " patch", "diff --git", "+", "-", "import os", "error", "Traceback"]
    text = lambda n: "".join(rng.choice(words, n))  # noqa: E731
    msgs = [{"role": "system", "content": "You are an agent.\n"}, {"role": "user", "content": text(30)}]
    for _ in range(turns):
        msgs += [{"role": "assistant", "content": text(20)}, {"role": "user", "content": text(25)}]
    return msgs


def _calls_of(session: str, thread: list[dict[str, str]]) -> list[Call]:
    return [Call(session, n, thread[:i], m["content"])
            for n, (i, m) in enumerate((i, m) for i, m in enumerate(thread) if m["role"] == "assistant")]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer with a ChatML template, saved as a Hugging Face tokenizer directory: merges
    cross word and newline boundaries often enough to catch a tokenisation that depends on where pieces are cut."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["".join(m["content"] for m in _conversation(6, seed)) for seed in range(20)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    path = tmp_path_factory.mktemp("bpe")
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bpe_dir)


@pytest.fixture()
def session_jsonl(tmp_path) -> Path:
    """Two sessions of a chat agent (each call re-sends the conversation) in the generic JSONL format."""
    trajs = [Trajectory("generic", f"s{i}", _calls_of(f"s{i}", _conversation(4, seed=i))) for i in range(2)]
    path = tmp_path / "calls.jsonl"
    write_jsonl(trajs, path)
    return path


# ------------------------------------------------------------------------------------------------------ loaders

@needs_traces
def test_development_set_rebuilds_sources_md_counts():
    """Call counts and character sums per framework as SOURCES.md states them (AutoCodeRover's order is also checked
    against each info.log by the loader itself)."""
    loaded = load_traces([TRACES])
    assert loaded.skipped == []
    got: dict[str, list[int]] = {}
    for traj in loaded.trajectories:
        row = got.setdefault(traj.framework, [0, 0, 0, 0])
        row[0] += 1
        row[1] += len(traj.calls)
        row[2] += sum(len(c.response) for c in traj.calls)
        row[3] += sum(len(m["content"]) for c in traj.calls for m in c.messages)
    assert got == {
        "AutoCodeRover": [36, 856, 734_892, 7_690_583],
        "SWE-agent": [90, 1_008, 710_389, 23_389_914],
        "mini-swe-agent": [25, 834, 871_853, 39_441_855],
    }


@needs_traces
def test_swe_agent_and_mini_calls_are_history_prefixes():
    """Each call's prompt is exactly the messages before its response, so consecutive calls extend each other."""
    src = load_source(next((TRACES / "SWE-agent__gpt-4-0125-preview" / "cost_2_1").glob("*.traj")))
    raw = json.loads(src.path.read_text())["history"]
    calls = src.trajectories[0].calls
    positions = [i for i, m in enumerate(raw) if m["role"] == "assistant"]
    assert len(calls) == len(positions)
    for call, i in zip(calls, positions):
        assert call.messages == [{"role": m["role"], "content": m["content"]} for m in raw[:i]]
        assert call.response == raw[i]["content"]


@needs_traces
def test_autocoderover_order_is_checked_against_info_log(tmp_path):
    task = next((TRACES / "AutoCodeRover__gpt-4-0125-preview").glob("acr-run-*/*/*/agent_proxy_2.json")).parent
    copy = tmp_path / task.name
    shutil.copytree(task, copy)
    assert len(load_source(copy).trajectories[0].calls) == sum(
        1 for line in (copy / "info.log").open(errors="replace") if "Raw model response:" in line)
    # two rounds' helper calls swapped: the rebuilt order no longer matches the log
    a, b = copy / "agent_proxy_1.json", copy / "agent_proxy_2.json"
    a_text, b_text = a.read_text(), b.read_text()
    for path, text in ((a, b_text), (b, a_text)):
        path.chmod(0o644)
        path.write_text(text)
    with pytest.raises(TraceFormatError, match="info.log") as err:
        load_source(copy)
    assert err.value.path == copy


def test_truncated_and_malformed_files_name_the_file(tmp_path):
    good = {"history": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "trajectory": []}
    truncated = tmp_path / "cut.traj"
    truncated.write_text(json.dumps(good)[:40])
    with pytest.raises(TraceFormatError, match="cut.traj.*truncated") as err:
        load_traces([truncated])
    assert err.value.path == truncated

    bad_role = tmp_path / "role.traj.json"
    bad_role.write_text(json.dumps({"messages": [{"content": "no role"}], "trajectory_format": "mini-swe-agent-1"}))
    with pytest.raises(TraceFormatError, match=r"role.traj.json.*messages\[0\]"):
        load_traces([bad_role])

    lines = tmp_path / "calls.jsonl"
    lines.write_text('{"messages": [{"role": "user", "content": "x"}], "response": "y"}\n{"messages": [\n')
    with pytest.raises(TraceFormatError, match="calls.jsonl: line 2"):
        load_traces([lines])

    no_response = tmp_path / "noresp.jsonl"
    no_response.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(TraceFormatError, match="noresp.jsonl: line 1.*'response'"):
        load_traces([no_response])


def test_unknown_format_names_the_file(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("just some text\n")
    with pytest.raises(UnknownFormatError, match="notes.txt"):
        load_traces([notes])
    other_json = tmp_path / "config.json"
    other_json.write_text('{"model": "gpt-4", "temperature": 0.2}')
    with pytest.raises(UnknownFormatError, match="config.json"):
        detect_format(other_json)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(TraceFormatError, match="no agent traces"):
        load_traces([empty_dir])


def test_detection_by_content_without_the_usual_suffix(tmp_path):
    mini = tmp_path / "run.json"
    mini.write_text(json.dumps({"trajectory_format": "mini-swe-agent-1", "info": {}, "messages": [
        {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}))
    swe = tmp_path / "run2.json"
    swe.write_text(json.dumps({"environment": "x", "trajectory": [], "history": [
        {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "info": {}}))
    assert detect_format(mini) == "mini-swe-agent"
    assert detect_format(swe) == "swe-agent"
    assert [c.response for c in load_source(swe).trajectories[0].calls] == ["a"]


def test_skip_bad_replays_the_rest_and_counts_skipped(tmp_path, session_jsonl):
    folder = tmp_path / "logs"
    folder.mkdir()
    shutil.copy(session_jsonl, folder / "a.jsonl")
    shutil.copy(session_jsonl, folder / "c.jsonl")
    (folder / "b.jsonl").write_text('{"messages": [{"role": "user"')
    (folder / "d.traj").write_text("not json")
    with pytest.raises(TraceFormatError, match="b.jsonl"):
        load_traces([folder])
    loaded = load_traces([folder], skip_bad=True)
    assert [s.path.name for s in loaded.sources] == ["a.jsonl", "c.jsonl"]
    assert sorted(p.name for p, _ in loaded.skipped) == ["b.jsonl", "d.traj"]
    assert sum(len(t.calls) for t in loaded.trajectories) == 2 * 2 * 4


def _same(a: list[Trajectory], b: list[Trajectory]) -> bool:
    return [(t.framework, t.session_id, t.calls) for t in a] == [(t.framework, t.session_id, t.calls) for t in b]


@pytest.mark.parametrize("openai", [False, True])
def test_generic_jsonl_round_trip(tmp_path, openai):
    trajs = [Trajectory("my-agent", f"s{i}", _calls_of(f"s{i}", _conversation(3, seed=i))) for i in range(3)]
    path = tmp_path / "out.jsonl"
    write_jsonl(trajs, path, openai=openai)
    assert detect_format(path) == "jsonl"
    assert _same(load_source(path).trajectories, trajs)


@needs_traces
def test_real_trajectory_round_trips_through_jsonl(tmp_path):
    src = load_source(next((TRACES / "mini-swe-agent__gemini-3-pro-preview").rglob("*.traj.json")))
    write_jsonl(src.trajectories, tmp_path / "x.jsonl")
    assert _same(load_source(tmp_path / "x.jsonl").trajectories, src.trajectories)


def test_openai_pair_and_text_prompt_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"session_id": "a", "request": {"model": "m", "temperature": 0, "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]},
         "response": {"object": "chat.completion", "choices": [{"index": 0, "message": {
             "role": "assistant", "content": "hi"}}], "usage": {"prompt_tokens": 5}}},
        {"session_id": "b", "prompt": "def f(x):\n", "response": "    return x\n"},
        {"session_id": "a", "request": {"messages": [{"role": "user", "content": "again"}]},
         "response": {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": []}}]}},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    a, b = load_source(path).trajectories
    assert (a.session_id, b.session_id) == ("a", "b")
    assert a.calls[0].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"}]
    assert [c.response for c in a.calls] == ["hi", ""]
    assert [c.index for c in a.calls] == [0, 1]
    assert b.calls == [Call("b", 0, [], "    return x\n", "def f(x):\n")]
    with pytest.raises(ValueError, match="plain-text prompt"):
        write_jsonl([b], tmp_path / "no.jsonl", openai=True)


# ------------------------------------------------------------------------------------------------------ tokenisation

def _chatml_pieces(messages: list[dict[str, str]]) -> list[str]:
    """The ChatML rendering cut by hand at every message content."""
    out = [f"<|im_start|>{messages[0]['role']}\n"]
    for prev, msg in zip(messages, messages[1:]):
        out += [prev["content"], f"<|im_end|>\n<|im_start|>{msg['role']}\n"]
    return out + [messages[-1]["content"], "<|im_end|>\n<|im_start|>assistant\n"]


def test_message_pieces_follow_the_template_and_extend_prompts(bpe, bpe_dir, session_jsonl, tmp_path):
    """Each prompt is its rendering tokenised piece by piece (so it decodes to the template's text), and each call's
    prompt starts with the previous call's prompt + response tokens. (Tokenising the whole rendering could merge
    across a piece boundary, e.g. a newline with a content's leading spaces; this BPE is trained to do so.)"""
    enc = lambda s: bpe(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    loaded = load_traces([session_jsonl])
    tok = TraceTokenizer(bpe_dir, cache_dir=tmp_path / "cache")
    tokenized = tok.tokenize(loaded.sources, progress=False)
    assert tok.stats["whole_prompt_calls"] == 0
    for traj, ttraj in zip(loaded.trajectories, tokenized):
        for n, (call, tcall) in enumerate(zip(traj.calls, ttraj.calls)):
            assert tcall.prompt.tolist() == [t for piece in _chatml_pieces(call.messages) for t in enc(piece)]
            full = bpe.apply_chat_template(call.messages, tokenize=False, add_generation_prompt=True)
            assert bpe.decode(tcall.prompt) == full
            assert tcall.response.tolist() == enc(call.response) + enc("<|im_end|>")
            if n:
                prev = ttraj.calls[n - 1]
                assert tcall.prompt[:len(prev.prompt) + len(prev.response)].tolist() == (
                    prev.prompt.tolist() + prev.response.tolist())
        assert session_links(ttraj) == [None] + list(range(len(ttraj.calls) - 1))


def test_unseparable_template_falls_back_to_whole_prompts(bpe, tmp_path, session_jsonl):
    """A template that trims contents cannot be cut into pieces: each prompt is then tokenised whole."""
    trimmed = tmp_path / "trimmed"
    bpe.save_pretrained(trimmed)
    template = CHATML.replace("message['content']", "message['content'] | trim")
    config = json.loads((trimmed / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (trimmed / "tokenizer_config.json").write_text(json.dumps(config))
    (trimmed / "chat_template.jinja").write_text(template)
    loaded = load_traces([session_jsonl])
    tok = TraceTokenizer(trimmed, cache_dir=tmp_path / "cache")
    tokenized = tok.tokenize(loaded.sources, progress=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(trimmed)
    calls = [c for t in loaded.trajectories for c in t.calls]
    assert tok.stats["whole_prompt_calls"] == len(calls)
    for call, tcall in zip(calls, (c for t in tokenized for c in t.calls)):
        full = hf.apply_chat_template(call.messages, tokenize=False, add_generation_prompt=True)
        assert tcall.prompt.tolist() == hf(full, add_special_tokens=False)["input_ids"]


def test_text_prompts_extend_token_wise(bpe, bpe_dir, tmp_path):
    path = tmp_path / "completions.jsonl"
    p0 = "def add(a, b):\n"
    r0 = "    return a + b\n"
    p1 = p0 + r0 + "\ndef sub(a, b):\n"
    path.write_text("\n".join(json.dumps({"session_id": "s", "prompt": p, "response": r})
                              for p, r in [(p0, r0), (p1, "    return a - b\n"), ("unrelated", "x")]))
    (traj,) = TraceTokenizer(bpe_dir, cache_dir=tmp_path / "c").tokenize(load_traces([path]).sources, progress=False)
    enc = lambda s: bpe(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert traj.calls[0].prompt.tolist() == enc(p0)
    assert traj.calls[0].response.tolist() == enc(r0)  # no chat template: no end-of-turn token
    assert traj.calls[1].prompt.tolist() == enc(p0) + enc(r0) + enc("\ndef sub(a, b):\n")
    assert session_links(traj) == [None, 0, None]


def test_tokenisation_cache_hit_on_second_run(bpe_dir, session_jsonl, tmp_path):
    sources = load_traces([session_jsonl]).sources
    first = TraceTokenizer(bpe_dir, cache_dir=tmp_path / "cache")
    a = first.tokenize(sources, progress=False)
    assert (first.stats["cache_misses"], first.stats["cache_hits"]) == (1, 0)
    assert first.cache_path(sources[0]).is_file()
    second = TraceTokenizer(bpe_dir, cache_dir=tmp_path / "cache")
    b = second.tokenize(load_traces([session_jsonl]).sources, progress=False)
    assert (second.stats["cache_misses"], second.stats["cache_hits"]) == (0, 1)
    assert second._hf is None  # the tokenizer was never loaded
    for ta, tb in zip(a, b):
        for ca, cb in zip(ta.calls, tb.calls):
            assert np.array_equal(ca.prompt, cb.prompt) and np.array_equal(ca.response, cb.response)
    # another file content is another key
    session_jsonl.write_text(session_jsonl.read_text().replace("agent", "robot"))
    third = TraceTokenizer(bpe_dir, cache_dir=tmp_path / "cache")
    third.tokenize(load_traces([session_jsonl]).sources, progress=False)
    assert third.stats["cache_misses"] == 1


def test_chat_pieces_on_a_template_with_a_default_system_prompt():
    """SmolLM2's template adds a system prompt when the first message is not one: the head piece carries it."""
    from jinja2 import Template

    template = Template(
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    pieces = ChatPieces(lambda msgs, gen: template.render(messages=msgs, add_generation_prompt=gen))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    got = pieces.pieces(msgs)
    assert got == ["<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\n", "hi",
                   "<|im_end|>\n<|im_start|>assistant\n", "yo", "<|im_end|>\n<|im_start|>user\n", "x",
                   "<|im_end|>\n<|im_start|>assistant\n"]
    assert pieces.assistant_footer() == "<|im_end|>\n"


@pytest.mark.slow
@needs_traces
def test_smollm2_message_pieces_equal_whole_prompt_tokenisation(tmp_path):
    """On real traces with the embedded tokenizer, message-wise tokenisation equals tokenising each rendered prompt."""
    from transformers import AutoTokenizer

    files = sorted((TRACES / "SWE-agent__gpt-4-0125-preview" / "cost_2_1").glob("*.traj"))[:2]
    loaded = load_traces(files)
    tok = TraceTokenizer("smollm2", cache_dir=tmp_path)
    tokenized = tok.tokenize(loaded.sources, progress=False)
    hf = AutoTokenizer.from_pretrained(tok.directory)
    for traj, ttraj in zip(loaded.trajectories, tokenized):
        for call, tcall in list(zip(traj.calls, ttraj.calls))[::5]:
            full = hf.apply_chat_template(call.messages, tokenize=False, add_generation_prompt=True)
            assert tcall.prompt.tolist() == hf(full, add_special_tokens=False)["input_ids"]
            assert tcall.response.tolist() == hf(call.response, add_special_tokens=False)["input_ids"] + [
                hf.convert_tokens_to_ids("<|im_end|>")]


# ------------------------------------------------------------------------------------------------------ replay

class CorruptOracle:
    """A toy proposer that knows each request's true response and proposes its next K tokens with the token at
    `wrong_at` replaced; it checks that it is fed exactly the response, in order."""

    def __init__(self, responses: dict[int, list[int]], wrong_at: int):
        self.responses, self.wrong_at = responses, wrong_at
        self.pos: dict[int, int] = {}
        self.started: list[tuple[int, int | None]] = []
        self.finished: list[int] = []

    def start_request(self, rid, prompt, *, extends=None):
        self.pos[rid] = 0
        self.started.append((rid, extends))

    def append(self, rid, tokens):
        truth = self.responses[rid][self.pos[rid]:self.pos[rid] + len(tokens)]
        assert list(tokens) == truth
        self.pos[rid] += len(tokens)

    def speculate(self, rid, num_speculative_tokens=None, *, tree=False):
        draft = list(self.responses[rid][self.pos[rid]:self.pos[rid] + num_speculative_tokens])
        if len(draft) > self.wrong_at:
            draft[self.wrong_at] = -1
        return Proposal.chain(draft)

    def finish_request(self, rid):
        assert self.pos[rid] == len(self.responses[rid])
        self.finished.append(rid)


def brute_force(responses: list[list[int]], k: int, wrong_at: int) -> tuple[int, int, int]:
    """(steps, proposed, accepted) by emitting tokens one at a time: draft tokens while they match, then the
    target's own token."""
    steps = proposed = accepted = 0
    for resp in responses:
        out: list[int] = []
        while len(out) < len(resp):
            draft = list(resp[len(out):len(out) + k])
            if len(draft) > wrong_at:
                draft[wrong_at] = -1
            steps += 1
            proposed += len(draft)
            for t in draft:
                if len(out) < len(resp) and t == resp[len(out)]:
                    out.append(t)
                    accepted += 1
                else:
                    break
            if len(out) < len(resp):
                out.append(resp[len(out)])
    return steps, proposed, accepted


def test_replay_oracle_matches_brute_force_and_hand_counts():
    rng = np.random.default_rng(1)
    # session 1: three calls, each prompt = previous prompt + response + new user tokens; session 2: one call
    calls1, prompt = [], rng.integers(0, 50, 20).astype(np.int32)
    for n in range(3):
        resp = rng.integers(0, 50, 10 + 7 * n).astype(np.int32)
        calls1.append(TokenizedCall(prompt, resp))
        prompt = np.concatenate([prompt, resp, rng.integers(0, 50, 5).astype(np.int32)])
    calls2 = [TokenizedCall(rng.integers(0, 50, 8).astype(np.int32), rng.integers(0, 50, 10).astype(np.int32))]
    trajs = [TokenizedTrajectory("fw", "a", calls1), TokenizedTrajectory("fw", "b", calls2)]
    responses = [c.response.tolist() for c in calls1 + calls2]
    k, wrong_at = 4, 2
    toys: list[CorruptOracle] = []

    def make() -> CorruptOracle:
        toys.append(CorruptOracle(dict(enumerate(responses)), wrong_at))
        return toys[-1]

    stats = replay(trajs, [ProposerSpec("toy", make)], k, progress=False)["toy"]["fw"]
    steps, proposed, accepted = brute_force(responses, k, wrong_at)
    assert (stats.steps, int(stats.draft_tokens.sum()), int(stats.accepted.sum())) == (steps, proposed, accepted)
    assert stats.response_tokens == sum(map(len, responses)) == int(stats.produced.sum())
    # by hand for the 10-token response of session b: steps draft 4/4/4/1 tokens, accept 2/2/2/1, emit 3/3/3/1
    toy = toys[0]
    assert toy.started == [(0, None), (1, 0), (2, 1), (3, None)]
    assert toy.finished == [0, 1, 2, 3]
    last = slice(stats.steps - 4, stats.steps)
    assert stats.draft_tokens[last].tolist() == [4, 4, 4, 1]
    assert stats.accepted[last].tolist() == [2, 2, 2, 1]
    assert stats.produced[last].tolist() == [3, 3, 3, 1]
    summary = stats.summary(VerifyCost())
    assert summary["tokens_per_step"] == pytest.approx(sum(map(len, responses)) / steps)
    assert summary["acceptance_rate"] == pytest.approx(accepted / proposed)
    # with a slow target the proposer's microseconds vanish: speedup = n t(0) / sum of t(k) per step
    slow = VerifyCost({0: 1000.0, 1: 1000.0, 4: 2000.0})
    expected = stats.response_tokens * 1000.0 / sum(2000.0 if d == 4 else 1000.0 if d in (0, 1) else
                                                    1000.0 + (d - 1) * 1000.0 / 3 for d in stats.draft_tokens.tolist())
    assert stats.projected_speedup(slow) == pytest.approx(expected, rel=1e-3)


def test_session_links_skip_calls_that_do_not_extend():
    """AutoCodeRover-like: a helper call with its own prompt between two main calls; the next main call extends the
    first main call, not the helper."""
    a = TokenizedCall(np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32))
    helper = TokenizedCall(np.array([9, 9], np.int32), np.array([8], np.int32))
    b = TokenizedCall(np.array([1, 2, 3, 4, 5, 6], np.int32), np.array([7], np.int32))
    c = TokenizedCall(np.array([1, 2, 3, 4, 6], np.int32), np.array([7], np.int32))
    assert session_links(TokenizedTrajectory("fw", "s", [a, helper, b, c])) == [None, None, 0, None]


# ------------------------------------------------------------------------------------------------------ CLI

def test_cli_writes_json_layout_and_plot(bpe_dir, session_jsonl, tmp_path, capsys):
    from hybridspec.cli import main

    (tmp_path / "broken.jsonl").write_text("{")
    out_json, out_png = tmp_path / "out" / "r.json", tmp_path / "out" / "r.png"
    rc = main(["replay", str(session_jsonl), str(tmp_path / "broken.jsonl"), "--proposer", "suffix,ngram",
               "--num-speculative-tokens", "8", "--tokenizer", str(bpe_dir), "--cache-dir", str(tmp_path / "cache"),
               "--json", str(out_json), "--plot", str(out_png), "--skip-bad"])
    assert rc == 0
    printed = capsys.readouterr()
    assert "skipped 1 bad file" in printed.out and "broken.jsonl" in printed.out
    data = json.loads(out_json.read_text())
    keys = {"calls", "response_tokens", "steps", "tokens_per_step", "acceptance_rate", "us_per_speculate_p50",
            "us_per_speculate_p99", "us_per_append_token", "projected_speedup"}
    assert set(data) == {"frameworks", "overall"}
    assert set(data["frameworks"]) == {"generic"}
    for section in (data["frameworks"]["generic"], data["overall"]):
        assert set(section) == {"suffix", "ngram"}
        for metrics in section.values():
            assert set(metrics) == keys
            assert metrics["calls"] == 8
            assert metrics["tokens_per_step"] == pytest.approx(metrics["response_tokens"] / metrics["steps"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rc = main(["replay", str(tmp_path / "broken.jsonl"), "--proposer", "ngram", "--tokenizer", str(bpe_dir)])
    assert rc == 2
    assert "broken.jsonl" in capsys.readouterr().err
    rc = main(["replay", str(session_jsonl), "--proposer", "magic", "--tokenizer", str(bpe_dir)])
    assert rc == 2
    assert "magic" in capsys.readouterr().err


def test_tree_oracle_takes_the_longest_matching_path():
    """accepted_length on random trees equals brute force over every root-to-node path."""
    from hybridspec.agent_traces.replay import accepted_length

    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        parents = [int(rng.integers(-1, i)) if i else -1 for i in range(n)]
        tokens = [int(t) for t in rng.integers(0, 3, n)]
        for i in range(n):  # siblings have distinct tokens, as every proposer's trees do
            while any(parents[j] == parents[i] and tokens[j] == tokens[i] for j in range(i)):
                tokens[i] += 3
        target = [int(t) for t in rng.integers(0, 3, int(rng.integers(0, 8)))]

        def path(i):
            return path(parents[i]) + [tokens[i]] if i >= 0 else []

        best = max([len(path(i)) for i in range(n) if path(i) == target[:len(path(i))]], default=0)
        assert accepted_length(Proposal(tokens, parents, [1.0] * n, float(n)), target) == best
    assert accepted_length(Proposal.chain([4, 5, 6]), [4, 5, 7]) == 2


def test_cli_replays_token_trees(bpe_dir, session_jsonl, tmp_path):
    from hybridspec.cli import main

    out = {}
    for tree in (False, True):
        out[tree] = tmp_path / f"r{tree}.json"
        assert main(["replay", str(session_jsonl), "--proposer", "suffix", "--num-speculative-tokens", "8",
                     "--tokenizer", str(bpe_dir), "--cache-dir", str(tmp_path / "cache"), "--json", str(out[tree])]
                    + (["--tree"] if tree else [])) == 0
    chain, tree = (json.loads(out[t].read_text())["overall"]["suffix"] for t in (False, True))
    assert chain["response_tokens"] == tree["response_tokens"] > 0
    assert tree["acceptance_rate"] != chain["acceptance_rate"]  # the trees were drafted and scored as trees
