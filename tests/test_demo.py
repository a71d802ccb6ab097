"""`hybridspec demo`, the README's first command: both methods pay their own prompts (the ratio is speculation's
alone), the outputs are the same, the headline says what it measures, and a first run says what it sets up."""
from __future__ import annotations

import io

import pytest

from hybridspec.tools.demo import run_demo


def test_the_demo_compares_speculation_alone_and_a_first_run_talks(tmp_path, monkeypatch, capsys):
    from hybridspec.tools.testing import tiny_llama, tiny_tokenizer

    model_dir = tmp_path / "tiny"
    tiny_llama(vocab_size=128, max_position_embeddings=4096).save_pretrained(model_dir)
    tiny_tokenizer(128).save_pretrained(model_dir)
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path / "cache"))  # a first run on this machine
    out = io.StringIO()
    result = run_demo(str(model_dir), turns=3, max_new_tokens=12, threads=1, out=out)
    text = out.getvalue()
    assert result["identical"] and result["speedup"] > 0
    runs = result["prompt_tokens_run"]
    assert runs["none"] == runs["suffix"] and runs["none"][0] > runs["none"][1] > 0  # each ran its own prompts
    assert text.count("[ plain]") == text.count("[suffix]") == 3
    assert "x plain greedy decoding in tokens/s of whole calls" in text and "outputs identical: yes" in text
    said = capsys.readouterr().err
    assert "measuring what a verification pass costs on this machine (once)" in said and "done in" in said
    assert "1/" in said  # its progress, a line per table
    run_demo(str(model_dir), turns=1, max_new_tokens=4, threads=1, out=io.StringIO())
    assert "(once)" not in capsys.readouterr().err  # measured once per machine


@pytest.mark.slow
def test_the_demo_on_smollm2_runs_as_the_readme_says(capsys):
    from hybridspec.cli import main

    assert main(["demo", "--turns", "2", "--max-new-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "outputs identical: yes" in out and "ready in" in out
