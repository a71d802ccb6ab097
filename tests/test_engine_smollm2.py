"""The exactness guarantee on the real SmolLM2-135M-Instruct (converted from the embedded GGUF on first use): greedy
speculative decoding returns the same tokens as plain greedy decoding on an agent-like prompt and a chat prompt, with
chains and trees, at batch 1 and 2, with each shipped drafter head (P-EAGLE, LSTM, EAGLE-3), and for stateless calls
served from the prefix cache. References come from an engine without speculation or prefix cache."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

AGENT_SYSTEM = ("You are a coding agent. Reply with one shell command in a ```bash block; you will see its output.")
AGENT_TURNS = [
    "Fix the bug: `add(2, 3)` in calc.py returns 6. Start by reading the file.",
    """<returncode>0</returncode>
<output>
def add(a, b):
    \"\"\"Return the sum of a and b.\"\"\"
    return a * b


def sub(a, b):
    \"\"\"Return a minus b.\"\"\"
    return a - b
</output>""",
]
CHAT = [{"role": "user", "content": "Give three tips for writing clear emails."}]
MAX_NEW = 96


@pytest.fixture(scope="module")
def engine():
    from hybridspec.runtime.engine import Engine

    return Engine.from_pretrained("smollm2")


@pytest.fixture(scope="module")
def agent_prompt(engine):
    """The second turn of an agent session: the model's own first reply, then a tool observation to copy from."""
    session = engine.session(system=AGENT_SYSTEM, max_new_tokens=MAX_NEW, speculate="none")
    session.send(AGENT_TURNS[0])
    return session.prompt_tokens([{"role": "user", "content": AGENT_TURNS[1]}])


@pytest.fixture(scope="module")
def uncached(engine):
    """Plain greedy decoding of whole prompts: no speculation, no prefix cache."""
    from hybridspec.runtime.engine import Engine

    return Engine(engine.target, engine.tokenizer, prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def references(uncached, agent_prompt):
    return {name: uncached.generate(prompt, max_new_tokens=MAX_NEW, speculate="none").token_ids
            for name, prompt in (("agent", agent_prompt), ("chat", uncached.encode(CHAT)))}


def test_stateless_calls_reuse_the_prefix_cache_and_stay_exact(engine, uncached, agent_prompt, references):
    """An agent's next call re-sends the conversation: with the prefix cache warm it runs only the new tokens and
    returns what an uncached run of the whole prompt returns."""
    first = engine.generate(agent_prompt, max_new_tokens=MAX_NEW)
    assert first.token_ids == references["agent"]
    follow = agent_prompt + first.token_ids + engine.tokenizer.encode(
        "\n<|im_start|>user\n<returncode>0</returncode>\n<output>ok</output><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)
    second = engine.generate(follow, max_new_tokens=MAX_NEW)
    assert second.stats.prefill_tokens < 40
    assert second.token_ids == uncached.generate(follow, max_new_tokens=MAX_NEW, speculate="none").token_ids


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_speculation_is_exact_on_agent_and_chat_prompts(engine, agent_prompt, references, tree):
    for name, prompt in (("agent", agent_prompt), ("chat", engine.encode(CHAT))):
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, speculate="suffix", tree=tree)
        assert result.token_ids == references[name], name
    # the agent prompt holds text to copy: speculation must have committed several tokens per step there
    agent = engine.generate(agent_prompt, max_new_tokens=MAX_NEW, speculate="suffix", tree=tree)
    assert agent.stats.tokens_per_step > 1.5


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_speculation_is_exact_at_batch_2(engine, agent_prompt, references, tree):
    results = engine.generate([agent_prompt, CHAT], max_new_tokens=MAX_NEW, speculate="suffix", tree=tree)
    assert [r.token_ids for r in results] == [references["agent"], references["chat"]]


def test_session_matches_uncached_generation(engine, agent_prompt, references):
    """A session (KV cache kept across turns, suffix cache fed turn by turn) gives the same second reply."""
    session = engine.session(system=AGENT_SYSTEM, max_new_tokens=MAX_NEW, speculate="suffix")
    session.send(AGENT_TURNS[0])
    reply = session.send(AGENT_TURNS[1])
    assert reply.prompt_token_ids == agent_prompt
    assert reply.token_ids == references["agent"]
    assert reply.stats.prefill_tokens < len(agent_prompt) // 2


@pytest.mark.parametrize("kind", ["peagle", "lstm", "eagle3", "fasteagle", "suffix+peagle", "suffix+fasteagle"])
def test_shipped_drafters_are_exact_and_accept_tokens(engine, agent_prompt, references, kind):
    results = engine.generate([agent_prompt, CHAT], max_new_tokens=MAX_NEW, speculate=kind)
    assert [r.token_ids for r in results] == [references["agent"], references["chat"]]
    chat = engine.generate(CHAT, max_new_tokens=MAX_NEW, speculate=kind)
    assert chat.token_ids == references["chat"]
    # a trained head drafts some of SmolLM2's own chat reply (chance is ~0 over a 49k vocabulary)
    assert chat.stats.accepted_tokens > 0


def test_a_gguf_file_is_a_model(engine, agent_prompt, tmp_path, monkeypatch):
    """`hybridspec serve FILE.gguf`: any GGUF transformers reads is converted once into the cache and runs; here the
    embedded SmolLM2 GGUF, passed as a user passes a file, decodes as the embedded model does."""
    from hybridspec.model.loading import resolve_model, smollm2_gguf
    from hybridspec.runtime.engine import Engine

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    directory = resolve_model(smollm2_gguf())
    assert directory.parent == tmp_path / "gguf" and (directory / "config.json").is_file()
    assert resolve_model(smollm2_gguf()) == directory  # converted once
    loaded = Engine.from_pretrained(str(smollm2_gguf()), verify_cost=None)
    prompt = agent_prompt[-300:]
    assert loaded.generate(prompt, max_new_tokens=16, speculate="suffix").token_ids == \
        engine.generate(prompt, max_new_tokens=16, speculate="none").token_ids
