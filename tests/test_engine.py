"""Engine guarantees on a tiny random Llama: greedy speculative decoding is token-identical to plain greedy decoding
(chains, trees, batches, every kind of proposer), speculative sampling keeps the target's distribution, sessions reuse
their KV cache and feed the suffix cache, and bad input gives clear errors. Prefix caching and concurrent callers:
tests/test_prefix_cache.py."""
from __future__ import annotations

import importlib.util
import math
import pickle
import random
from collections import Counter

import pytest
import torch

from hybridspec.errors import ContextLengthExceeded, InvalidParameter, InvalidParameterType
from hybridspec.runtime.engine import Engine
from hybridspec.proposal import Proposal
from hybridspec.model.target import TargetModel
from hybridspec.tools.testing import chi_square_p_value, tiny_llama, tiny_tokenizer

VOCAB = 128


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    # no cost gate: every draft is verified, so the acceptance paths are exercised
    return Engine(TargetModel(tiny_model), tiny_tokenizer, router=lambda proposals, contexts: list(proposals))


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts, half of them repetitive so that suffix and n-gram proposers find matches."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2:
            unit = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
            prompts.append((unit * 8)[: rng.randint(8, 40)])
        else:
            prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))])
    return prompts


class RandomProposer:
    """Random drafts (chains or trees) of random length: almost always rejected, sometimes empty."""

    num_speculative_tokens = 16
    drafts_trees = True
    prefers_trees = False
    wants_target_features = False

    def __init__(self, seed: int, tree: bool = False):
        self.rng, self.tree = random.Random(seed), tree

    def start_request(self, request_id, prompt, *, extends=None):
        pass

    def append(self, request_id, tokens):
        pass

    def finish_request(self, request_id):
        pass

    def abort_request(self, request_id):
        pass

    def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
        n = self.rng.randint(0, num_speculative_tokens)
        parents = [self.rng.randint(-1, i - 1) for i in range(n)] if tree else list(range(-1, n - 1))
        return Proposal([self.rng.randrange(VOCAB) for _ in range(n)], parents, [1.0] * n, float(n), "random")


class NoisyOracle(RandomProposer):
    """Knows the greedy continuation of each prompt and drafts it with random corruptions (and, for trees, random
    siblings around the true path): drafts are partly accepted, so accept paths, bonus tokens and KV compaction run."""

    def __init__(self, references: dict[tuple, list[int]], seed: int, tree: bool = False):
        super().__init__(seed, tree)
        self.references, self.state = references, {}

    def start_request(self, request_id, prompt, *, extends=None):
        self.state[request_id] = [self.references[tuple(prompt)], 0]

    def append(self, request_id, tokens):
        self.state[request_id][1] += len(tokens)

    def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
        ref, pos = self.state[request_id]
        truth = ref[pos:pos + self.rng.randint(0, num_speculative_tokens)]
        tokens = [t if self.rng.random() < 0.8 else self.rng.randrange(VOCAB) for t in truth]
        parents = list(range(-1, len(tokens) - 1))
        if tree:  # siblings hang off random nodes of the path, up to the budget
            while len(tokens) < num_speculative_tokens and self.rng.random() < 0.7:
                parents.append(self.rng.randint(-1, len(tokens) - 1))
                tokens.append(self.rng.randrange(VOCAB))
            order = sorted(range(len(tokens)), key=lambda i: self._depth(parents, i))  # parents before children
            index = {old: new for new, old in enumerate(order)}
            tokens = [tokens[i] for i in order]
            parents = [index[parents[i]] if parents[i] >= 0 else -1 for i in order]
        return Proposal(tokens, parents, [1.0] * len(tokens), float(len(tokens)), "oracle")

    @staticmethod
    def _depth(parents, i):
        d = 0
        while parents[i] >= 0:
            i, d = parents[i], d + 1
        return d


def test_plain_greedy_matches_transformers_generate(engine, tiny_model):
    for prompt in random_prompts(4, seed=1):
        ours = engine.generate(prompt, max_new_tokens=24, speculate="none")
        with torch.no_grad():
            ref = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=engine.tokenizer.eos_token_id, pad_token_id=0)[0, len(prompt):]
        assert ours.token_ids == ref.tolist()


def test_ignore_eos_runs_a_call_to_its_length_through_the_same_tokens(engine):
    prompt = next(p for p in random_prompts(20, seed=5)
                  if engine.generate(p, max_new_tokens=60, speculate="none").finish_reason == "eos")
    ended = engine.generate(prompt, max_new_tokens=60, speculate="none")
    plain, suffix = (engine.generate(prompt, max_new_tokens=60, speculate=s, ignore_eos=True)
                     for s in ("none", "suffix"))
    assert plain.finish_reason == "length" and len(plain.token_ids) == 60
    assert plain.token_ids[:len(ended.token_ids)] == ended.token_ids and suffix.token_ids == plain.token_ids


PROPOSERS = ["random-chain", "random-tree", "oracle-chain", "oracle-tree", "suffix", "suffix-tree", "ngram"]


def proposer_of(kind: str, references: dict[tuple, list[int]]):
    """The `speculate=` of a PROPOSERS entry: a RandomProposer, a NoisyOracle over `references`, or a built-in name."""
    tree = kind.endswith("tree")
    if kind.startswith("random"):
        return RandomProposer(seed=3, tree=tree)
    if kind.startswith("oracle"):
        return NoisyOracle(references, seed=4, tree=tree)
    return kind.split("-")[0]


@pytest.mark.parametrize("kind", PROPOSERS)
@pytest.mark.parametrize("batch", [False, True])
def test_speculative_greedy_is_token_identical(engine, kind, batch):
    prompts = random_prompts(8, seed=hash(kind) % 1000)
    references = {tuple(p): engine.generate(p, max_new_tokens=40, speculate="none").token_ids for p in prompts}
    tree = kind.endswith("tree")
    speculate = proposer_of(kind, references)
    if batch:
        results = engine.generate(prompts, max_new_tokens=40, speculate=speculate, num_speculative_tokens=6,
                                  tree=tree)
    else:
        results = [engine.generate(p, max_new_tokens=40, speculate=speculate, num_speculative_tokens=6, tree=tree)
                   for p in prompts]
    for prompt, result in zip(prompts, results):
        assert result.token_ids == references[tuple(prompt)]
        assert result.finish_reason in ("eos", "length")
    if kind.startswith("oracle"):
        stats = results[0].stats if batch else engine.stats
        assert stats.accepted_tokens > 0 and stats.tokens_per_step > 1


@pytest.mark.parametrize("kind", ["random-chain", "random-tree", "suffix", "none"])
def test_a_prompt_run_with_its_first_step_changes_no_token(tiny_model, tiny_tokenizer, kind):
    """A single prompt's uncached tokens run in its first verification pass (one pass of the target less per call);
    the tokens are those of a separate prefill, for chain and tree drafts alike."""
    passes = []
    target = TargetModel(tiny_model)
    forward = target.forward
    target.forward = lambda *args, **kwargs: passes.append(1) or forward(*args, **kwargs)
    engines = {fuse: Engine(target, tiny_tokenizer, router=lambda proposals, contexts: list(proposals),
                            prefix_cache_bytes=0) for fuse in (True, False)}
    engines[False].prefill.defer = False
    for prompt in random_prompts(6, seed=11):
        got = {}
        for fuse, engine in engines.items():
            speculate = RandomProposer(seed=5, tree=kind == "random-tree") if kind.startswith("random") else kind
            passes.clear()
            result = engine.generate(prompt, max_new_tokens=12, speculate=speculate, num_speculative_tokens=4,
                                     tree=kind == "random-tree")
            got[fuse] = (result.token_ids, len(passes), result.stats)
        assert got[True][0] == got[False][0]
        assert got[False][1] - got[True][1] == (len(prompt) > 1)
        stats = got[True][2]
        assert stats.prefill_tokens == len(prompt) - 1 and stats.steps == got[False][2].steps
        assert (stats.prefill_s > 0) == (len(prompt) > 1) and stats.verify_s > 0


def test_stops_cut_at_the_same_token(engine):
    runs = [(p, engine.generate(p, max_new_tokens=40, speculate="none")) for p in random_prompts(6, seed=9)]
    prompt, plain = next((p, r) for p, r in runs if len(r.token_ids) >= 20)
    stop = engine.tokenizer.decode(plain.token_ids[10:12])
    spec = engine.generate(prompt, max_new_tokens=40, speculate=NoisyOracle({tuple(prompt): plain.token_ids}, 1),
                           stop=[stop])
    base = engine.generate(prompt, max_new_tokens=40, speculate="none", stop=stop)
    assert spec.token_ids == base.token_ids and spec.finish_reason == base.finish_reason == "stop"
    assert stop not in spec.text and plain.text.startswith(spec.text)
    assert stop in engine.tokenizer.decode(spec.token_ids)
    short = engine.generate(prompt, max_new_tokens=5, speculate=NoisyOracle({tuple(prompt): plain.token_ids}, 2))
    assert short.token_ids == plain.token_ids[:5] and short.finish_reason == "length"


def test_stream_yields_the_generated_text(engine):
    deltas = list(engine.stream("Hello there", max_new_tokens=30))
    assert len(deltas) > 1 and "".join(deltas) == engine.generate("Hello there", max_new_tokens=30).text


def test_a_prompt_of_token_ids_may_be_a_tensor(engine):
    ids = engine.encode("Hello there")
    assert engine.generate(torch.tensor(ids), max_new_tokens=8).token_ids == \
        engine.generate(ids, max_new_tokens=8).token_ids


def test_a_stream_ends_with_the_result_generate_returns(engine):
    plain = engine.generate("Hello there", max_new_tokens=30)
    stream = engine.stream("Hello there", max_new_tokens=30)
    assert stream.result is None
    text = "".join(stream)
    result = stream.result
    assert result is not None and text == result.text == plain.text and result.token_ids == plain.token_ids
    assert result.finish_reason == plain.finish_reason and result.stats.new_tokens == len(plain.token_ids)


def test_stats_split_drafts_by_source_and_count_cached_prompt_tokens(engine):
    prompt = "ls -la; cat setup.py; ls -la; cat setup.py; ls -la; cat setup.py"
    engine.generate(prompt, max_new_tokens=20, speculate="suffix")
    again = engine.generate(prompt, max_new_tokens=20, speculate="suffix").stats  # the prompt's KV is cached now
    assert again.cached_tokens == again.prompt_tokens - 1 and again.prefill_tokens == 0
    suffix = again.by_source["suffix"]
    assert set(again.by_source) == {"suffix"} and suffix.won == again.proposals > 0
    assert (suffix.draft_tokens, suffix.accepted_tokens) == (again.draft_tokens, again.accepted_tokens)
    assert suffix.drafts == again.proposals - again.skipped_proposals
    none = engine.generate(prompt, max_new_tokens=5, speculate="none").stats
    assert none.by_source == {} and none.draft_tokens == 0


def test_a_stream_closed_early_aborts_its_request(engine):
    """A caller that stops reading a stream leaves nothing behind: the request is aborted on the proposer (not
    finished: its partial response does not enter the global index), and nothing stays live."""
    before = engine.suffix_cache.stats()
    stream = engine.stream("Hello there", max_new_tokens=400, ignore_eos=True)
    next(stream)
    with engine.loop.paused():  # before the loop's next step: it cannot have finished
        assert not stream.ended
        stream.cancel()
    stream.close()
    after = engine.suffix_cache.stats()
    assert after["live_requests"] == 0
    assert after["finished_requests"] == before["finished_requests"]
    assert after["global_tokens"] == before["global_tokens"]
    list(engine.stream("Hello there", max_new_tokens=30))  # read to the end: finished, its response indexed
    assert engine.suffix_cache.stats()["finished_requests"] == before["finished_requests"] + 1


def test_a_stream_dropped_before_its_first_step_takes_nothing(engine):
    """A client that leaves between the request's checks and its first step: the prefix cache keeps its entry and
    the suffix cache has no request of it."""
    prompt = "cat setup.py and then ls -la the folder"
    engine.generate(prompt, max_new_tokens=8)
    live = engine.suffix_cache.stats()["live_requests"]
    engine.stream(prompt + " again", max_new_tokens=8).close()
    assert engine.suffix_cache.stats()["live_requests"] == live
    again = engine.generate(prompt + " again", max_new_tokens=8).stats
    assert again.cached_tokens >= len(engine.encode(prompt)) - 1 > 0


def test_session_reuses_kv_cache_and_feeds_suffix_cache(engine, tmp_path):
    session = engine.session(system="You are terse.", max_new_tokens=25)
    replies = []
    for turn in ["ls -la", "cat setup.py", "ls -la"]:
        replies.append(session.send(turn))
    # later turns prefill only the new pieces, never the whole conversation
    assert replies[0].stats.prefill_tokens == replies[0].stats.prompt_tokens - 1
    for r in replies[1:]:
        assert r.stats.prefill_tokens < r.stats.prompt_tokens // 2
    # the conversation's tokens are exactly prompt + reply of every turn, and a fresh, uncached run of the last
    # prompt (with the exact same tokens) gives the same reply
    last = replies[-1]
    assert session.tokens == last.prompt_token_ids + last.token_ids
    uncached = Engine(engine.target, engine.tokenizer, prefix_cache_bytes=0)
    fresh = uncached.generate(last.prompt_token_ids, max_new_tokens=25, speculate="none")
    assert fresh.token_ids == last.token_ids
    assert session.messages[-1] == {"role": "assistant", "content": last.text}
    assert engine.suffix_cache.stats()["session_hits"] >= 2  # turns extend the previous one
    path = tmp_path / "suffix.bin"
    engine.save_cache(path)
    other = Engine(engine.target, engine.tokenizer)
    other.load_cache(path)
    assert other.suffix_cache.stats()["global_tokens"] == engine.suffix_cache.stats()["global_tokens"] > 0


def test_session_tokens_follow_the_chat_template(engine):
    session = engine.session(max_new_tokens=8, speculate="none")
    session.send("hi")
    session.send({"role": "tool", "content": "output"})
    rendered = engine.tokenizer.apply_chat_template(session.messages, tokenize=False)
    text = engine.tokenizer.decode(session.tokens)
    # what the model saw is the template's rendering (an unfinished last reply lacks the closing tag)
    assert rendered.startswith(text) or text.startswith(rendered.rstrip("\n"))


def test_bad_input_gives_clear_errors(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate("")
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.generate([5, VOCAB])
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.generate([-1, 5])
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
            engine.generate("abc", max_new_tokens=bad)
    with pytest.raises(ValueError, match="context is 512"):
        engine.generate([5] * 512)
    with pytest.raises(ValueError, match="speculate must be one of"):
        engine.generate("abc", speculate="eagle")
    with pytest.raises(TypeError, match="not a Proposer"):
        engine.generate("abc", speculate=object())
    with pytest.raises(ValueError, match="tree=True needs a proposer that drafts trees"):
        engine.generate("abc", speculate="ngram", tree=True)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate("abc", temperature=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine.generate("abc", num_speculative_tokens=-1)
    with pytest.raises(TypeError, match="a prompt is a string"):
        engine.generate([1.5])
    with pytest.raises(ValueError, match=r"messages\[0\]\.role: None is not one of system, developer, user, "
                                         r"assistant"):
        engine.session().send({"content": "no role"})


@pytest.mark.parametrize("prompt, options, param, kind", [
    ("", {}, "prompt", InvalidParameter),
    ([5, VOCAB], {}, "prompt", InvalidParameter),
    ([5] * 512, {}, "prompt", ContextLengthExceeded),
    ([1.5], {}, "prompt", InvalidParameterType),
    ([{"role": "user", "content": "a"}, {"role": "user"}], {}, "messages[1].content", InvalidParameter),
    ([{"role": "user", "content": "a"}, "text"], {}, "messages[1]", InvalidParameter),
    ([{"role": "bot", "content": "a"}], {}, "messages[0].role", InvalidParameter),
    ("abc", {"max_new_tokens": 0}, "max_new_tokens", InvalidParameter),
    ("abc", {"temperature": -1}, "temperature", InvalidParameter),
    ("abc", {"top_p": 0}, "top_p", InvalidParameter),
    ("abc", {"top_k": -1}, "top_k", InvalidParameter),
    ("abc", {"speculate": "eagle"}, "speculate", InvalidParameter),
    ("abc", {"speculate": object()}, "speculate", InvalidParameterType),
    ("abc", {"speculate": "peagle"}, "speculate", InvalidParameter),  # the shipped head does not fit this target
    ("abc", {"num_speculative_tokens": -1}, "num_speculative_tokens", InvalidParameter),
    ("abc", {"tree": True, "speculate": "ngram"}, "tree", InvalidParameter),
    ("abc", {"stop": ["a", ""]}, "stop", InvalidParameter),
    ("abc", {"seed": 1.5}, "seed", InvalidParameter),
])
def test_bad_input_errors_name_their_parameter(engine, prompt, options, param, kind):
    """What a caller (the server's 400s) reads instead of the message; still ValueErrors (and TypeErrors for the
    wrong kind of argument)."""
    for call in (engine.generate, engine.stream):
        with pytest.raises(InvalidParameter) as e:
            call(prompt, **options)
        assert type(e.value) is kind and e.value.param == param and isinstance(e.value, ValueError)
        assert isinstance(e.value, TypeError) == (kind is InvalidParameterType)
    assert pickle.loads(pickle.dumps(e.value)).param == param  # e.g. from a vLLM worker process


def test_an_unknown_option_is_a_plain_type_error(engine):
    with pytest.raises(TypeError, match="unexpected arguments: temprature") as e:
        engine.stream("abc", temprature=0)
    assert not isinstance(e.value, InvalidParameter)


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": 5}],
     r"messages\[1\]\.content must be a string, got int"),
    ([{"role": "user", "content": ["a"]}], r"messages\[0\]\.content must be a string, got list"),
    ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role: 'wizard' is not one of"),
    ([{"role": "user", "content": "ok"}, "just text"], r"messages\[1\]: a message is an object"),
])
def test_bad_chat_messages_name_the_field_in_every_entry_point(engine, messages, error):
    """The chat template would raise jinja's UndefinedError, a TypeError, or render an unknown role as valid."""
    with pytest.raises(ValueError, match=error):
        engine.generate(messages, max_new_tokens=2)
    with pytest.raises(ValueError, match=error):
        engine.stream(messages, max_new_tokens=2)  # checked when the stream is made, before any step
    with pytest.raises(ValueError, match=error):
        engine.encode(messages)
    assert engine.generate([{"role": "user", "content": "ok"}], max_new_tokens=2).token_ids  # the engine goes on


def test_a_router_is_checked_against_the_contract_like_a_proposer(tiny_model, tiny_tokenizer):
    class NoExpectation:
        def __call__(self, proposals, contexts):
            return list(proposals)

        def observe(self, proposals, accepted):
            pass

    with pytest.raises(TypeError, match=r"NoExpectation is not a Router: it lacks plan, expected_tokens, rate, "
                                        r"step_ms \(the contract is hybridspec.router.Router"):
        Engine(TargetModel(tiny_model), tiny_tokenizer, router=NoExpectation())
    with pytest.raises(TypeError, match="is not a Router: it lacks plan, observe, expected_tokens, rate"):
        Engine(TargetModel(tiny_model), tiny_tokenizer, router=object())
    wrapped = Engine(TargetModel(tiny_model), tiny_tokenizer,
                     router=lambda proposals, contexts: [Proposal.empty() for _ in proposals])  # a plain function
    assert wrapped.router.expected_tokens(Proposal.chain([1, 2], probs=[0.5, 0.25])) == 0.75
    assert wrapped.generate("abc", max_new_tokens=4).stats.draft_tokens == 0  # it verifies nothing
    broken = Engine(TargetModel(tiny_model), tiny_tokenizer, router=lambda proposals, contexts: [])
    with pytest.raises(ValueError, match="the router returned 0 proposals for 1 sequences"):
        broken.generate("abc", max_new_tokens=4)


def test_context_end_finishes_with_length(engine):
    result = engine.generate([5] * 500, max_new_tokens=100, speculate="suffix")
    assert len(result.token_ids) <= 12 and (result.finish_reason == "length" or result.token_ids[-1] == 2)


# ---------------------------------------------------------------------------------------------------------------
# the cost gate (default router)


def test_gated_engine_is_exact_and_skips_hopeless_drafts(tiny_model, tiny_tokenizer):
    # the default router, the cost gate, with the built-in tables (on a tiny model this machine's may call drafts free)
    gated = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None)
    prompt = random_prompts(2, seed=5)[0]
    plain = gated.generate(prompt, max_new_tokens=30, speculate="none")
    low = Proposal.chain  # a proposer whose drafts promise little

    class Hopeless(RandomProposer):
        def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
            n = num_speculative_tokens
            return low([self.rng.randrange(VOCAB) for _ in range(n)], probs=[0.05 ** (i + 1) for i in range(n)],
                       source="hopeless")

    result = gated.generate(prompt, max_new_tokens=30, speculate=Hopeless(0))
    assert result.token_ids == plain.token_ids
    assert result.stats.draft_tokens == 0 and result.stats.skipped_proposals == result.stats.proposals > 0


# ---------------------------------------------------------------------------------------------------------------
# sampling keeps the target distribution


SMALL_VOCAB = 8


class SamplingProposer(RandomProposer):
    """Two-token drafts: a chain, or a tree (two siblings, one with a child). Deterministic drafts (one-hot, distinct
    siblings) or drafts sampled from random draft logits (siblings i.i.d. from their parent's distribution)."""

    def __init__(self, seed: int, tree: bool, with_logits: bool):
        super().__init__(seed, tree)
        self.with_logits = with_logits
        self.gen = torch.Generator().manual_seed(seed)

    def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
        parents = [-1, -1, 0][:num_speculative_tokens] if tree else [-1, 0][:num_speculative_tokens]
        if not self.with_logits:
            tokens = self.rng.sample(range(SMALL_VOCAB), 2) + [self.rng.randrange(SMALL_VOCAB)]
            tokens = tokens[:len(parents)] if tree else [tokens[0], tokens[2]][:len(parents)]
            return Proposal(tokens, parents, [1.0] * len(parents), float(len(parents)), "det")
        per_parent = {p: 2.0 * torch.randn(SMALL_VOCAB, generator=self.gen) for p in set(parents)}
        logits = torch.stack([per_parent[p] for p in parents])
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=self.gen)[:, 0].tolist()
        return Proposal(tokens, parents, [0.5] * len(parents), 0.5 * len(parents), "model", draft_logits=logits)


def exact_two_token_distribution(model, prompt, eos, vocab: int = SMALL_VOCAB) -> dict[tuple, float]:
    """P(first two generated tokens) under plain sampling at temperature 1, from transformers' forward."""
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        dist = {}
        for a in range(vocab):
            if a == eos:
                dist[(a,)] = p1[a].item()
                continue
            p2 = torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
            for b in range(vocab):
                dist[(a, b)] = (p1[a] * p2[b]).item()
    return dist


@pytest.fixture(scope="module")
def small_vocab_engine():
    model = tiny_llama(vocab_size=SMALL_VOCAB, seed=3, init_std=0.2)
    return Engine(TargetModel(model), tiny_tokenizer(SMALL_VOCAB), router=lambda ps, cs: list(ps)), model


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("with_logits", [False, True])
def test_speculative_sampling_keeps_the_target_distribution(small_vocab_engine, tree, with_logits):
    engine, model = small_vocab_engine
    prompt = [3, 5, 4, 6]
    eos = engine.tokenizer.eos_token_id
    expected = exact_two_token_distribution(model, prompt, eos)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-9)
    proposer = SamplingProposer(seed=11 + 2 * tree + with_logits, tree=tree, with_logits=with_logits)
    n, counts = 0, Counter()
    for call in range(6):
        results = engine.generate([prompt] * 500, max_new_tokens=3, temperature=1.0, speculate=proposer, tree=tree,
                                  seed=1000 * call + 2 * tree + with_logits)
        for r in results:
            counts[tuple(r.token_ids[:1]) if r.token_ids[0] == eos else tuple(r.token_ids[:2])] += 1
        n += len(results)
        assert results[0].stats.accepted_tokens > 0  # drafts were tried and some accepted
    assert chi_square_p_value([counts.get(c, 0) for c in expected], list(expected.values())) > 1e-3


def test_chi_square_detects_a_wrong_distribution(small_vocab_engine):
    """The statistical test has power: plain greedy outputs (a point mass) are far from the sampled distribution."""
    engine, model = small_vocab_engine
    prompt = [3, 5, 4, 6]
    expected = exact_two_token_distribution(model, prompt, engine.tokenizer.eos_token_id)
    greedy = engine.generate(prompt, max_new_tokens=2, speculate="none").token_ids
    assert chi_square_p_value([3000 * (c == tuple(greedy[:2])) for c in expected], list(expected.values())) < 1e-6


def test_model_resolution(tmp_path, monkeypatch):
    from hybridspec.model.loading import cache_dir, resolve_model

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match="neither 'smollm2', a GGUF file nor a local Hugging Face model"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        resolve_model(tmp_path / "missing.gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="transformers cannot read broken.gguf"):
        resolve_model(tmp_path / "broken.gguf")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())
    # an environment without gguf (.venv-vllm, .venv-peers) is told how to get the conversion, not transformers' hint
    find_spec = importlib.util.find_spec
    with monkeypatch.context() as m, pytest.raises(ImportError, match="needs the gguf package.*scripts/setup.sh"):
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
        resolve_model(tmp_path / "broken.gguf")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "model") == tmp_path / "model"
