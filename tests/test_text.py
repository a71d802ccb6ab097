"""A sequence's text as the engine builds it, token by token (`hybridspec.runtime.text`): equal to decoding all the
tokens at once, on tokens that split characters (byte-level BPE: a CJK character or an emoji is several tokens) and
words; stop strings cut where decoding every prefix would; released text never taken back; tool calls parsed as
`parse_tool_calls` parses the whole; and the work per token bounded, not growing with the output."""
from __future__ import annotations

import random

import pytest

from hybridspec.grammar.tool_calls import parse_tool_calls
from hybridspec.runtime.text import IncrementalDetokenizer, SequenceText

TEXTS = [
    "naïve café — 日本語のテキストです。 🚀🎉 résumé, Ångström, ½ × π ≈ 1.57",
    "def parse(text: str) -> int:\n    return sum(ord(c) for c in text)  # ünïcödé 🙂\n",
    "<returncode>0</returncode>\n<output>\nREADME.md  setup.py  tests/  日本/\n</output>",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer (as SmolLM2's, GPT-2's): any character outside its merges is several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog; def return sum for in"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def decoder(tokenizer, counted: list[int] | None = None):
    def decode(ids: list[int]) -> str:
        if counted is not None:
            counted.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)
    return decode


def token_streams(tokenizer, seed: int = 0) -> list[list[int]]:
    """The texts' tokens, random ids (incomplete UTF-8 sequences, special tokens among them), and a text cut inside a
    character."""
    rng = random.Random(seed)
    streams = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    streams += [[rng.randrange(len(tokenizer)) for _ in range(200)] for _ in range(5)]
    streams.append(tokenizer.encode("日本", add_special_tokens=False)[:-1])  # ends mid-character
    return streams


def test_the_text_token_by_token_is_the_text_of_all_tokens(tokenizer):
    for tokens in token_streams(tokenizer):
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        detokenizer = IncrementalDetokenizer(decoder(tokenizer))
        text = ""
        for token in tokens:
            text += detokenizer.add(token)
            assert whole.startswith(text)  # never taken back
            assert detokenizer.text == text
        assert text + detokenizer.flush() == whole == detokenizer.text
    assert any(len(tokenizer.decode([t])) < 1 or "\ufffd" in tokenizer.decode([t])
               for t in tokenizer.encode(TEXTS[0], add_special_tokens=False))  # the test splits characters


def test_the_work_per_token_does_not_grow_with_the_output(tokenizer):
    """Decoding the whole output at every step would read n^2 / 2 tokens over n; this reads a few per token."""
    tokens = [t for _ in range(40) for t in tokenizer.encode(TEXTS[0] + TEXTS[1], add_special_tokens=False)]
    counted: list[int] = []
    text = SequenceText(decoder(tokenizer, counted), stops=("never appears",))
    for start in range(0, len(tokens), 3):  # steps of three tokens
        assert text.add(tokens[start:start + 3]) is None
        text.release(finished=False)
    assert len(tokens) > 4000 and sum(counted) < 12 * len(tokens) and max(counted) < 16


def reference_stop(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> tuple[int, str]:
    """Where decoding every prefix finds a stop string first (the tokens kept), and the text cut before it."""
    for j in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:j], skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return j, text[:min(found)]
    return len(tokens), tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("stops", [("é",), ("テキスト", "🎉"), ("\n", "def"), ("sum(ord", "π ≈"), ("not there",)])
def test_stop_strings_cut_where_decoding_every_prefix_would_and_released_text_is_never_taken_back(tokenizer, stops):
    rng = random.Random(len(stops[0]))
    for tokens in token_streams(tokenizer)[:3]:
        kept, expected = reference_stop(tokenizer, tokens, stops)
        text, released, done = SequenceText(decoder(tokenizer), stops), "", 0
        while done < len(tokens):
            step = tokens[done:done + rng.randint(1, 6)]
            cut = text.add(step)
            done += len(step) if cut is None else cut
            finished = cut is not None or done == len(tokens)
            released += text.release(finished)[0]
            assert expected.startswith(released)  # nothing released is ever part of a stop string
            if finished:
                break
        assert (done, released, text.text) == (kept, expected, expected)
        assert text.release(True) == ("", [])  # released whole once


def test_tool_calls_are_parsed_as_the_text_is_released(tokenizer):
    reply = ('I will look first.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls 日本/ && echo \\"🚀\\""}}'
             '\n</tool_call>\n<tool_call>\n{"name": "read", "arguments": {"path": "café.py"}}\n</tool_call>')
    tokens = tokenizer.encode(reply, add_special_tokens=False)
    text = SequenceText(decoder(tokenizer), tools=True)
    events = []
    for start in range(0, len(tokens), 2):
        text.add(tokens[start:start + 2])
        events += text.release(finished=False)[1]
    events += text.release(finished=True)[1]
    content, calls = text.tool_calls()
    want_content, want_calls = parse_tool_calls(reply)
    assert content == want_content == "I will look first."
    assert [c["function"] for c in calls] == [c["function"] for c in want_calls] and len(calls) == 2
    assert [e["id"] for e in events if isinstance(e, dict) and "id" in e] == [c["id"] for c in calls]


@pytest.mark.slow
def test_smollm2_text_token_by_token_is_its_text_of_all_tokens():
    """SmolLM2's own tokenizer, on an agent's text and on random ids."""
    from hybridspec.model.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    for tokens in token_streams(tokenizer, seed=1):
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        text = SequenceText(decoder(tokenizer))
        for start in range(0, len(tokens), 4):
            text.add(tokens[start:start + 4])
        assert text.release(finished=True)[0] == whole == text.text


@pytest.mark.slow
def test_the_stream_text_benchmark_runs_and_both_ways_give_the_same_text(tmp_path):
    import json

    import bench_stream_text

    result = bench_stream_text.main(["--lengths", "64,256", "--repeats", "1", "--json", str(tmp_path / "b.json")])
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert rows == result["rows"] and [r["tokens"] for r in rows] == [64, 256] and rows[1]["steps"] > 64
