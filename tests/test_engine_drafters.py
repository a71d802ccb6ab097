"""The engine with model drafters (speculate="peagle" | "lstm" | "eagle3" | "fasteagle") on tiny random targets:
greedy outputs are token-identical to plain greedy decoding (single, batched, sessions), the drafter's state follows
exactly the committed tokens (after every step it drafts what a drafter fed the whole sequence's features drafts),
sampling keeps the target's distribution, and mismatched drafters give clear errors."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from hybridspec.runtime.engine import Engine
from hybridspec.router import DraftCost, FunctionRouter, HybridProposer
from hybridspec.speculators import (DrafterProposer, Eagle3Drafter, EagleConfig, FastEagleDrafter, LayerConfig,
                                    LSTMConfig, LSTMDrafter, PEagleDrafter, TargetFeatures)
from hybridspec.speculators.registry import DRAFTER_KINDS
from hybridspec.model.target import TargetModel
from hybridspec.runtime.stats import GenerationStats
from hybridspec.tools.testing import chi_square_p_value, tiny_llama, tiny_tokenizer

from test_engine import exact_two_token_distribution

VOCAB = 16  # small enough that random drafters often agree with the target: accepted paths get exercised


def make_drafter(kind: str, model, seed: int = 0):
    """A random drafter for `model`, with sharpened logits (random weights give nearly flat ones)."""
    torch.manual_seed(seed)
    c = model.config
    if kind == "lstm":
        drafter = LSTMDrafter(LSTMConfig(input_hidden_dim=c.hidden_size, dim=32, vocab_size=c.vocab_size,
                                         num_speculative_tokens=3))
        head = drafter.head[0]
    else:
        num_layers = {"peagle": 2, "eagle3": 1, "fasteagle": 4}[kind]  # FastEagle: one layer per draft position
        config = EagleConfig(layer=LayerConfig.like_target(c), num_layers=num_layers,
                             target_hidden_size=c.hidden_size, target_vocab_size=c.vocab_size,
                             draft_vocab_size=c.vocab_size, aux_layer_ids=(2, c.num_hidden_layers // 2,
                                                                           c.num_hidden_layers - 3),
                             mask_token_id=0, num_speculative_tokens=4)
        cls = {"peagle": PEagleDrafter, "eagle3": Eagle3Drafter, "fasteagle": FastEagleDrafter}[kind]
        drafter = cls(config, embed_tokens=model.get_input_embeddings().weight)
        head = drafter.lm_head
    with torch.no_grad():
        head.weight.mul_(10)
    return drafter.eval()


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(vocab_size=VOCAB, seed=7, init_std=0.3)


def drafter_engine(target_model, bf16: bool) -> Engine:
    drafters = {kind: make_drafter(kind, target_model) for kind in DRAFTER_KINDS}
    return Engine(TargetModel(target_model), tiny_tokenizer(VOCAB), drafters=drafters, drafter_bf16=bf16,
                  router=lambda proposals, contexts: list(proposals))  # verify every draft


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "bf16"])
def engine(target_model, request):
    """Drafters with float32 products, or bfloat16 ones (outputs checked only)."""
    return drafter_engine(target_model, request.param)


@pytest.fixture(scope="module")
def fp32_engine(target_model):
    """Float32 drafters: their state is checked against a fresh drafter's to 2e-3."""
    return drafter_engine(target_model, False)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(n)]


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_with_a_drafter_is_token_identical(engine, kind, batch, tree):
    prompts = random_prompts(6, seed=len(kind))
    references = [engine.generate(p, max_new_tokens=32, speculate="none").token_ids for p in prompts]
    if batch:
        results = engine.generate(prompts, max_new_tokens=32, speculate=kind, tree=tree)
        accepted = results[0].stats.accepted_tokens
    else:
        results = [engine.generate(p, max_new_tokens=32, speculate=kind, tree=tree) for p in prompts]
        accepted = sum(r.stats.accepted_tokens for r in results)
    assert [r.token_ids for r in results] == references
    assert accepted > 0  # the accepted-path bookkeeping ran
    assert all(r.stats.draft_tokens <= 4 * r.stats.steps for r in results)  # K (chain) or nodes (tree): the drafter's


@pytest.mark.parametrize("speculate", ["peagle", "suffix+peagle"])
@pytest.mark.parametrize("context", [64, 16], ids=["whole-prompt", "window"])
def test_a_drafters_prompt_runs_in_its_steps_passes(target_model, speculate, context, monkeypatch):
    """A drafter's (or a hybrid's) single prompt runs in its steps' passes, as any other: with its first step (one
    pass less than a prefill of its own), or a chunk per step while another call runs. The features of the prompt's
    last `drafter_context` positions reach the drafter all the same (across chunk boundaries too, and when a running
    call that began with the same tokens lends it the positions before them): the same tokens and the same drafts
    (steps, accepted tokens) as with a prefill of its own."""
    def make(**kwargs) -> tuple[Engine, list[int]]:
        target, passes = TargetModel(target_model), []
        forward = target.forward
        target.forward = lambda *args, **kw: passes.append(1) or forward(*args, **kw)
        return Engine(target, tiny_tokenizer(VOCAB), drafters={"peagle": make_drafter("peagle", target_model)},
                      router=lambda proposals, contexts: list(proposals), prefix_cache_bytes=0,
                      drafter_context=context, **kwargs), passes

    (apart, apart_passes), (fused, fused_passes), (chunked, _) = make(), make(), make(prefill_chunk=5)
    apart.prefill.defer = False
    prompt = [t for p in random_prompts(8, seed=9) for t in p][:40]
    given = []  # the prompt features each drafter started from
    start_request = DrafterProposer.start_request

    def recording(self, request_id, tokens, *, features, extends=None):
        if features is not None:
            given.append(features)
        return start_request(self, request_id, tokens, features=features, extends=extends)

    monkeypatch.setattr(DrafterProposer, "start_request", recording)
    results = {}
    for name, engine in (("apart", apart), ("fused", fused)):
        results[name] = engine.generate(prompt, max_new_tokens=24, speculate=speculate, tree=False)
    other = chunked.stream(prompt[:6], max_new_tokens=400, speculate="none", ignore_eos=True)
    next(other)  # a call running beside it: the prompt goes in chunks of 5
    steps, ran_in = chunked.loop.run_step, []  # each step of the engine: whether the chunked call ran in its pass
    chunked.loop.run_step = lambda plan: ran_in.append(
        any(p.call.seqs[0].prompt_len == len(prompt) for p in plan.calls)) or steps(plan)
    with chunked.loop.paused():  # in line before the other call's next step: it is still running when this begins
        handle = chunked.stream(prompt, max_new_tokens=24, speculate=speculate, tree=False)
    results["chunked"] = handle.wait()[0]
    assert not other.ended
    other.close()
    want = results["apart"]
    for name, result in results.items():
        assert result.token_ids == want.token_ids, name
        assert (result.stats.steps, result.stats.accepted_tokens) == (want.stats.steps, want.stats.accepted_tokens)
    assert want.stats.accepted_tokens > 0
    assert len(given) == 3 and len(given[0]) == min(context, len(prompt) - 1)
    for features in given[1:]:
        assert len(features) == len(given[0])
        # float32 sums in another order (chunks of other widths, by oneDNN's product past eight rows and the small-row
        # kernel below) over 30 layers: equal but for rounding
        torch.testing.assert_close(features.aux, given[0].aux, atol=5e-4, rtol=1e-4)
        torch.testing.assert_close(features.final, given[0].final, atol=5e-4, rtol=1e-4)
    assert len(apart_passes) - len(fused_passes) == 1
    # the running call began with the same tokens: those positions whose features the drafter does not read are
    # copied from it (in-flight prefix sharing); the rest, 39 prompt tokens at most, run in chunks of 5, the last
    # with the first step
    copied = results["chunked"].stats.cached_tokens
    assert (copied > 0) == (context < len(prompt) - 1)
    assert sum(ran_in) == len(fused_passes) + -(-(len(prompt) - 1 - copied) // 5) - 1


def test_drafters_draft_trees_by_default(target_model):
    """tree=None: drafters and hybrids draft trees, the suffix cache chains; tree=False forces chains."""
    seen = []

    def router(proposals, contexts):
        seen.extend(p for p in proposals if len(p))
        return list(proposals)

    engine = Engine(TargetModel(target_model), tiny_tokenizer(VOCAB), router=router,
                    drafters={"peagle": make_drafter("peagle", target_model)})
    prompt = random_prompts(1, seed=3)[0]
    for speculate, tree, want_trees in [("peagle", None, True), ("suffix+peagle", None, True),
                                        ("peagle", False, False), ("suffix", None, False)]:
        seen.clear()
        engine.generate(prompt * 3, max_new_tokens=16, speculate=speculate, tree=tree, num_speculative_tokens=4)
        assert seen and any(not p.is_chain for p in seen) == want_trees, (speculate, tree)


def test_tree_drafts_accept_runner_up_tokens(engine):
    """With trees, some steps accept a sibling (a runner-up of the drafter), which a chain cannot: more tokens per
    step than the chain on the same prompts."""
    prompts = random_prompts(8, seed=11)
    chain = engine.generate(prompts, max_new_tokens=32, speculate="peagle", num_speculative_tokens=2, tree=False)
    tree = engine.generate(prompts, max_new_tokens=32, speculate="peagle", num_speculative_tokens=2, tree=True)
    assert [r.token_ids for r in tree] == [r.token_ids for r in chain]
    assert tree[0].stats.tokens_per_step > chain[0].stats.tokens_per_step


class CheckedProposer(DrafterProposer):
    """Before every draft, checks that the state built from the engine's features drafts what a drafter begun on the
    whole committed sequence (features from a plain transformers forward) drafts."""

    prefers_trees = False  # the check compares chains

    def __init__(self, drafter, model, aux_layer_ids):
        super().__init__(drafter)
        self.model, self.aux_layer_ids_, self.tokens, self.checked = model, aux_layer_ids, {}, 0

    def start_request(self, request_id, tokens, *, features, extends=None):
        super().start_request(request_id, tokens, features=features, extends=extends)
        self.tokens[request_id] = list(tokens)

    def append(self, request_id, tokens, *, features):
        super().append(request_id, tokens, features=features)
        self.tokens[request_id] += list(tokens)

    def speculate_many(self, request_ids, num_speculative_tokens, *, tree=False, load=None):
        proposals = super().speculate_many(request_ids, num_speculative_tokens, tree=tree, load=load)
        for request_id, proposal in zip(request_ids, proposals):
            sequence = self.tokens[request_id]
            if len(sequence) > 1 and len(proposal):
                with torch.no_grad():
                    out = self.model(torch.tensor([sequence[:-1]]), output_hidden_states=True)
                full = TargetFeatures.from_hidden_states(out.hidden_states, self.aux_layer_ids_)
                expected = self.drafter.propose(self.drafter.begin(full, sequence[1:]), len(proposal))
                assert proposal.token_ids == expected.token_ids
                torch.testing.assert_close(proposal.draft_logits, expected.draft_logits, atol=2e-3, rtol=1e-3)
                self.checked += 1
        return proposals


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_drafter_state_follows_the_committed_tokens(fp32_engine, target_model, kind):
    engine = fp32_engine
    proposer = CheckedProposer(engine.proposers.get(kind).drafter, target_model, engine.target.aux_layer_ids)
    prompts, accepted = random_prompts(4, seed=11), 0
    for prompt in prompts:
        plain = engine.generate(prompt, max_new_tokens=24, speculate="none")
        result = engine.generate(prompt, max_new_tokens=24, speculate=proposer)
        assert result.token_ids == plain.token_ids
        accepted += result.stats.accepted_tokens
    results = engine.generate(prompts, max_new_tokens=24, speculate=proposer)  # rows leave the batch as they finish
    assert proposer.checked > 20 and accepted + results[0].stats.accepted_tokens > 0


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_session_continues_the_drafter_state(fp32_engine, target_model, kind):
    """A session's later turns prefill only their new tokens; the drafter continues its state from the previous turn
    (extends=) and still drafts exactly what a drafter fed the whole conversation drafts."""
    engine = fp32_engine
    proposer = CheckedProposer(engine.proposers.get(kind).drafter, target_model, engine.target.aux_layer_ids)
    session = engine.session(max_new_tokens=16, speculate=proposer)
    plain = engine.session(max_new_tokens=16, speculate="none")
    for turn in ["ab", "cd ef", "gh"]:
        reply = session.send(turn)
        assert reply.token_ids == plain.send(turn).token_ids
        assert reply.stats.prefill_tokens < reply.stats.prompt_tokens or turn == "ab"
    assert proposer.checked > 10
    # each turn continued (and took over) the previous turn's state: one state, covering the whole conversation
    assert len(proposer.retained) == 1
    assert next(iter(proposer.retained.values())).length == len(session.tokens)


def test_drafter_proposer_rebuilds_when_the_prompt_does_not_continue(target_model):
    drafter = make_drafter("lstm", target_model)
    proposer = DrafterProposer(drafter, max_retained=1)
    h = target_model.config.hidden_size
    feats = lambda n: TargetFeatures(torch.randn(n, 3 * h), torch.randn(n, h))  # noqa: E731
    proposer.start_request("a", [3, 4, 5, 6], features=feats(3))
    proposer.append("a", [7], features=feats(1))
    proposer.finish_request("a")
    assert proposer.retained["a"].length == 5
    proposer.start_request("b", [3, 4, 5, 6, 7, 8, 9], features=feats(2), extends="a")  # continues at position 5
    assert proposer.live["b"].length == 7 and "a" not in proposer.retained
    proposer.finish_request("b")
    proposer.start_request("c", [3, 4, 5, 6, 7, 9, 9, 9], features=feats(4), extends="b")  # a different token 7
    assert proposer.live["c"].length == 8 and "b" not in proposer.retained
    with pytest.raises(ValueError, match="already running"):
        proposer.start_request("c", [3, 4], features=feats(1))
    with pytest.raises(ValueError, match="feature rows"):
        proposer.start_request("d", [3, 4], features=feats(2))


# ---------------------------------------------------------------------------------------------------------------
# sampling keeps the target distribution


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["peagle", "lstm", "fasteagle", "suffix+peagle", "suffix+peagle@free",
                                  "suffix+fasteagle@free", "peagle/tree", "suffix+peagle/tree"])
def test_sampling_with_a_drafter_keeps_the_target_distribution(kind):
    """Drafts sampled from the drafter (with its logits), and for the hybrid a mix of those and one-hot suffix drafts
    (the repeated prompt puts earlier answers in its cache; a drafter that costs nothing to run (@free) is run
    whenever its drafts are expected to beat the suffix draft; one that costs ten passes never, as even a draft
    accepted whole would not pay for it), through the cost gate: the outputs keep the target's distribution. /tree:
    deterministic trees of the drafter's top tokens instead."""
    from hybridspec.router import CostGate, DraftCost, HybridProposer

    vocab = 8
    model = tiny_llama(vocab_size=vocab, seed=3, init_std=0.2)
    kind, _, tree = kind.partition("/")
    kind, _, free = kind.partition("@")
    drafter = kind.split("+")[-1]
    free_passes = {}
    if (tree and "+" not in kind) or ("+" in kind and not free):
        # 500 rows of a tiny model: the step plan rightly verifies no draft (a draft token costs a row's share of the
        # pass); with passes that cost the same whatever they hold, the cost gate keeps the drafts to verify (and
        # whether a drafter pays does not hang on how fast this machine ran a tiny model's pass)
        free_passes = {"router": CostGate({"by_context": [{"context": 0, "draft_tokens": [0, 64], "ms": [1.0, 1.0]}],
                                           "pass": {"tokens": [1, 65536], "tokens_ms": [1.0, 1.0], "per_row_ms": 0}})}
    engine = Engine(TargetModel(model), tiny_tokenizer(vocab), drafters={drafter: make_drafter(drafter, model, seed=1)},
                    **free_passes)
    speculate = kind if "+" not in kind else HybridProposer(
        engine.suffix_cache, engine.proposers.get(drafter), engine.router,
        draft_cost=DraftCost({0: 1e-6 if free else 10.0}))
    prompt = [3, 5, 4, 6]
    eos = engine.tokenizer.eos_token_id
    expected = exact_two_token_distribution(model, prompt, eos, vocab)
    counts, n = Counter(), 0
    for call in range(6):
        results = engine.generate([prompt] * 500, max_new_tokens=3, temperature=1.0, speculate=speculate,
                                  num_speculative_tokens=2, seed=100 + call, tree=bool(tree))
        for r in results:
            counts[tuple(r.token_ids[:1]) if r.token_ids[0] == eos else tuple(r.token_ids[:2])] += 1
        n += len(results)
        assert results[0].stats.accepted_tokens > 0
    if free:  # both sources win often
        assert speculate.chosen["suffix"] > 100 and speculate.chosen[drafter] > 100
    elif "+" in kind:  # under this load the drafter stays idle, and the suffix drafts do the speculating
        assert speculate.drafter_runs == 0 and speculate.chosen["suffix"] > 100
    assert chi_square_p_value([counts.get(c, 0) for c in expected], list(expected.values())) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# errors


def test_drafter_errors(engine, target_model):
    with pytest.raises(ValueError, match="unknown kind"):
        Engine(engine.target, engine.tokenizer, drafters={"medusa": "x"})
    with pytest.raises(ValueError, match="speculate must be one of"):
        engine.generate([3, 4], max_new_tokens=4, speculate="eagle")
    other = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=1)
    with pytest.raises(ValueError, match="hidden size"):
        Engine(TargetModel(other), engine.tokenizer, drafters={"lstm": make_drafter("lstm", target_model)}
               ).generate([3, 4], max_new_tokens=4, speculate="lstm")
    # the shipped heads are SmolLM2's: a clear error, with what to do, on any other target
    with pytest.raises(ValueError, match="shipped peagle head is for SmolLM2"):
        Engine(engine.target, engine.tokenizer).generate([3, 4], max_new_tokens=4, speculate="peagle")


def test_engine_packs_its_own_copy_of_a_drafter(engine):
    """On CPU the engine runs drafters on oneDNN-packed weights: a copy, the caller's module stays trainable."""
    from hybridspec.model.linear import PackedLinear

    ours = engine.proposers.get("peagle").drafter
    theirs = engine.proposers.drafters["peagle"]
    assert ours is not theirs
    assert isinstance(ours.lm_head, PackedLinear) and type(theirs.lm_head) is torch.nn.Linear
    x = torch.randn(5, ours.lm_head.in_features)
    tol = 3e-2 if engine.proposers.drafter_bf16 else 1e-4  # bfloat16 products where the CPU has them
    assert ours.lm_head(x).dtype == torch.float32
    torch.testing.assert_close(ours.lm_head(x), theirs.lm_head(x), atol=tol, rtol=tol)
    exact = Engine(engine.target, engine.tokenizer, drafters=engine.proposers.drafters, drafter_bf16=False)
    torch.testing.assert_close(exact.proposers.get("peagle").drafter.lm_head(x), theirs.lm_head(x), atol=1e-4,
                               rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# the hybrid: suffix drafts where the text repeats, the drafter's elsewhere


class FreeVerification(FunctionRouter):
    """Verifies every draft in full, as if verification cost nothing more per token (rate = 1 + expected tokens,
    plain steps of 10 ms): a hybrid then runs its drafter wherever its drafts are expected to beat the suffix's."""

    def __init__(self):
        super().__init__(lambda proposals, contexts: list(proposals))

    def rate(self, proposal, context, load=None):
        return 1.0 + proposal.score

    def step_ms(self, context, load=None):
        return 10.0


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_hybrid_is_token_identical_and_uses_both(engine, batch):
    # repetitive prompts for the suffix cache, random ones for the drafter, none of them seen by the engine before
    rng = random.Random(23 + batch)
    prompts = [(lambda unit: (unit * 6)[:30])([rng.randrange(3, VOCAB) for _ in range(4)]) for _ in range(3)]
    prompts += random_prompts(3, seed=29 + batch)
    references = [engine.generate(p, max_new_tokens=32, speculate="none").token_ids for p in prompts]
    # a drafter that costs nothing to run: it runs wherever its drafts are expected to beat the suffix's
    hybrid = HybridProposer(engine.suffix_cache, engine.proposers.get("peagle"), FreeVerification(),
                            draft_cost=DraftCost({0: 1e-6}))
    if batch:
        results = engine.generate(prompts, max_new_tokens=32, speculate=hybrid)
    else:
        results = [engine.generate(p, max_new_tokens=32, speculate=hybrid) for p in prompts]
    assert [r.token_ids for r in results] == references
    assert hybrid.chosen["suffix"] > 0 and hybrid.chosen["peagle"] > 0
    stats = GenerationStats()
    for r in results[:1] if batch else results:
        stats.add(r.stats)
    assert stats.by_source["suffix"].won + stats.by_source["peagle"].won == sum(hybrid.chosen.values()) - \
        hybrid.chosen[""]
    assert stats.drafter_runs == hybrid.drafter_runs > 0
    # the engine's own hybrid, by the cost gate: exact too
    default = engine.generate(prompts, max_new_tokens=32, speculate="suffix+peagle")
    assert [r.token_ids for r in default] == references


def test_hybrid_runs_the_drafter_only_where_it_is_expected_to_pay():
    """Per step the hybrid compares the suffix draft's rate with the drafter's expected rate net of its cost (its
    catch-up of skipped positions and its draft, in plain steps), before the drafter runs."""
    from hybridspec.proposal import Proposal
    from hybridspec.router import DraftCost, HybridProposer

    class Fixed:
        drafts_trees = prefers_trees = False

        def __init__(self, proposal, k=4, wants_target_features=False):
            self.proposal, self.num_speculative_tokens, self.calls, self.log = proposal, k, 0, []
            self.wants_target_features, self.skipped = wants_target_features, 0

        def set_sampling(self, probs_fn, generator=None):
            pass

        def start_request(self, rid, prompt, **kw):
            self.log.append(("start", kw))

        def append(self, rid, tokens, **kw):
            self.log.append(("append", kw))
            self.skipped += len(tokens)

        def pending(self, rid):
            return self.skipped

        def context_length(self, rid):
            return 100

        def speculate(self, rid, num_speculative_tokens=None, *, tree=False):
            self.calls, self.skipped = self.calls + 1, 0
            n = num_speculative_tokens
            proposal = Proposal.chain(self.proposal.token_ids[:n], self.proposal.probs[:n], source=self.proposal.source)
            proposal.drafter_ran = self.wants_target_features  # the model drafter ran; the suffix cache has none
            return proposal

        def finish_request(self, rid):
            self.log.append(("finish", {}))

        def abort_request(self, rid):
            self.log.append(("abort", {}))

    suffix = Fixed(Proposal.chain([1, 2, 3, 4, 5], [0.9, 0.9, 0.9, 0.9, 0.9], source="suffix"))
    drafter = Fixed(Proposal.chain([7, 8, 9, 6], [0.8, 0.5, 0.2, 0.1], source="peagle"), wants_target_features=True)
    # drafting costs 1 ms (0.1 steps) plus 1 ms per 10 positions caught up
    hybrid = HybridProposer(suffix, drafter, FreeVerification(), num_speculative_tokens=5,
                            draft_cost=DraftCost({0: 1, 10: 2}))
    hybrid.start_request("r", [1, 2], features="F")
    hybrid.append("r", [3], features="G")
    assert suffix.log == [("start", {"extends": None}), ("append", {})]  # the suffix cache never sees features
    assert drafter.log == [("start", {"features": "F", "extends": None}), ("append", {"features": "G"})]
    strong = suffix.proposal
    # the suffix draft's rate 5.5 beats what even a draft of 4 tokens all accepted would give (5 / 1.11): not run
    assert not hybrid.speculate("r").drafter_ran and drafter.calls == 0 and hybrid.estimate("r").rate is None
    suffix.proposal = Proposal.chain([1, 2], [0.9, 0.9], source="suffix")  # 2.8 against at most 5 / 1.11: it may pay
    first = hybrid.speculate("r")  # nothing known of the drafter yet: it runs once; the suffix draft (1.8) wins
    assert first.source == "suffix" and first.drafter_ran and drafter.calls == 1
    assert hybrid.estimate("r").rate == pytest.approx(1 + 1.6)
    suffix.proposal = strong
    # the suffix's rate 5.5 beats the drafter's 2.6 / 1.1: not run
    again = hybrid.speculate("r")
    assert again.source == "suffix" and not again.drafter_ran and drafter.calls == 1
    suffix.proposal = Proposal.chain([1], [0.3], source="suffix")  # 1.3 against 2.6 / 1.1 = 2.36: run, and it wins
    assert hybrid.speculate("r").token_ids == [7, 8, 9, 6] and drafter.calls == 2
    hybrid.append("r", list(range(200)), features="H")  # 200 skipped positions: catching up costs 2.1 steps
    assert hybrid.speculate("r").source == "suffix" and drafter.calls == 2  # 1.3 > 2.6 / 3.1
    suffix.proposal = Proposal.empty("suffix")  # a plain step's 1.0 against 2.6 / 3.1: still not worth it
    assert len(hybrid.speculate("r")) == 0 and drafter.calls == 2
    drafter.skipped = 0
    assert hybrid.speculate("r", num_speculative_tokens=2).token_ids == [7, 8] and drafter.calls == 3
    assert hybrid.chosen == {"suffix": 4, "peagle": 2, "": 1} and hybrid.drafter_runs == 3
    # the text may change: a sequence that has not run the drafter for PROBE_AFTER steps runs it once more, and after
    # a probe that finds it still not paying, waits twice as long
    from hybridspec.router.hybrid import PROBE_AFTER

    suffix.proposal = Proposal.chain([1, 2], [0.9, 0.9], source="suffix")  # 2.8 > 2.6 / 1.1, and < 5 / 1.1
    for wait in (PROBE_AFTER, 2 * PROBE_AFTER):
        calls = drafter.calls
        for _ in range(wait):
            assert not hybrid.speculate("r").drafter_ran
        assert hybrid.speculate("r").drafter_ran and drafter.calls == calls + 1
    # no probe where even a perfect draft could not pay: the suffix's 5.5 against 5 / 1.1
    suffix.proposal, calls = strong, drafter.calls
    for _ in range(8 * PROBE_AFTER):
        assert not hybrid.speculate("r").drafter_ran
    assert drafter.calls == calls
    suffix.proposal = Proposal.empty("suffix")
    hybrid.start_request("s", [1, 2], features="F")  # another sequence: its own estimate, so its first step runs it
    assert hybrid.speculate("s").drafter_ran and hybrid.estimate("s").rate != hybrid.estimate("r").rate
    hybrid.finish_request("r")
    assert suffix.log[-1][0] == drafter.log[-1][0] == "finish"


def test_a_hybrid_weighs_this_machines_draft_cost(target_model, tmp_path, monkeypatch):
    """With the engine's costs measured here (verify_cost="auto", the default), a hybrid weighs its drafter by this
    machine's draft-cost table, measured once per machine and drafter and kept in the user cache; with the built-in
    verification tables (verify_cost=None), by the built-in table of its kind."""
    from hybridspec.model import calibration
    from hybridspec.router.cost import DEFAULT_DRAFT_MS

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    measured = []
    real = calibration.measure_draft_cost

    def counting(*args, **kwargs):
        measured.append(1)
        return real(*args, **{**kwargs, "repeats": 1})

    monkeypatch.setattr(calibration, "measure_draft_cost", counting)
    drafter = make_drafter("peagle", target_model)

    def hybrid(**kwargs):
        engine = Engine(TargetModel(target_model), tiny_tokenizer(VOCAB), drafters={"peagle": drafter}, **kwargs)
        return engine, engine.proposers.get("suffix+peagle")

    engine, measured_here = hybrid()
    table = dict(zip(measured_here.draft_cost.ns.astype(int).tolist(), measured_here.draft_cost.ms.tolist()))
    assert sorted(table) == list(calibration.DRAFT_COST_POSITIONS) and all(ms > 0 for ms in table.values())
    assert measured == [1]
    _, again = hybrid()
    assert measured == [1] and again.draft_cost.ms.tolist() == measured_here.draft_cost.ms.tolist()  # read back
    _, built_in = hybrid(verify_cost=None)
    assert dict(zip(built_in.draft_cost.ns.astype(int).tolist(), built_in.draft_cost.ms.tolist())) == \
        DEFAULT_DRAFT_MS["peagle"]
    prompt = random_prompts(1, seed=3)[0]
    assert engine.generate(prompt, max_new_tokens=16, speculate="suffix+peagle").token_ids == \
        engine.generate(prompt, max_new_tokens=16, speculate="none").token_ids


@pytest.mark.parametrize("speculate", ["peagle", "suffix+peagle"])
def test_sequences_stepped_together_draft_in_one_drafter_pass(target_model, speculate, monkeypatch):
    """The rows of a batch, and the greedy calls that share a step, draft in one pass of the drafter (its weights
    read once for all of them); outputs stay those of plain greedy decoding."""
    from hybridspec.speculators import PEagleDrafter

    passes = []
    forward = PEagleDrafter.forward_slots_many
    monkeypatch.setattr(PEagleDrafter, "forward_slots_many",
                        lambda self, runs, *a, **kw: passes.append(len(runs)) or forward(self, runs, *a, **kw))
    engine = Engine(TargetModel(target_model), tiny_tokenizer(VOCAB), drafters={"peagle": make_drafter(
        "peagle", target_model)}, router=lambda proposals, contexts: list(proposals))
    prompts = random_prompts(4, seed=21)
    plain = [engine.generate(p, max_new_tokens=12, speculate="none").token_ids for p in prompts]
    results = engine.generate(prompts[:2], max_new_tokens=12, speculate=speculate, tree=False)
    assert [r.token_ids for r in results] == plain[:2]
    assert max(passes) == 2  # both rows of the batch in one pass
    passes.clear()
    with engine.loop.paused():  # two calls that begin together, and step together
        handles = [engine.stream(p, max_new_tokens=12, speculate=speculate, tree=False) for p in prompts[2:]]
    assert [h.wait()[0].token_ids for h in handles] == plain[2:]
    assert max(passes) == 2  # the two calls' rows in one pass
