"""Structured output and tool calls under speculation (`hybridspec.grammar`): greedy decoding under a grammar returns
the tokens of plain constrained greedy decoding (an independent loop: transformers' forward, xgrammar's mask) for every
kind of draft; sampling keeps the masked target distribution (chi-square); drafts are cut where the grammar rejects
them, grammar-forced tokens are drafted and counted as their own source; bad grammars name their field."""
from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch
import xgrammar as xgr

from hybridspec import Engine, InvalidParameter
from hybridspec.grammar.constraint import grammar_spec
from hybridspec.model.target import TargetModel
from hybridspec.proposal import Proposal
from hybridspec.tools.testing import chi_square_p_value, tiny_llama, tiny_tokenizer
from test_engine import NoisyOracle, RandomProposer, SamplingProposer, SMALL_VOCAB

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["cmd", "n"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "step", "schema": SCHEMA, "strict": True}}
BASH = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
GRAMMARS = {
    "json_schema": dict(response_format=JSON_SCHEMA),
    "json_object": dict(response_format={"type": "json_object"}),
    "tools_required": dict(tools=BASH, tool_choice="required"),
    "tools_named": dict(tools=BASH, tool_choice={"type": "function", "function": {"name": "bash"}}),
}


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_tokenizer):
    # every draft verified (no cost gate), so the grammar's cuts and masks meet accepted and rejected drafts alike
    return Engine(TargetModel(tiny_model), tiny_tokenizer, router=lambda proposals, contexts: list(proposals))


def masked_greedy(model, prompt: list[int], compiled, max_new_tokens: int, eos: int) -> list[int]:
    """Plain constrained greedy decoding, written independently of the engine: the whole sequence through
    transformers' forward each token, xgrammar's mask on the last logits."""
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, model.config.vocab_size)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1:].float().clone()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            token = int(logits.argmax())
            out.append(token)
            if token == eos:
                break
            assert matcher.accept_token(token)
            ids.append(token)
    return out


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(2, 20))] for _ in range(n)]


@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_greedy_under_a_grammar_is_plain_constrained_greedy_for_every_draft(engine, tiny_model, grammar):
    options = GRAMMARS[grammar]
    compiled = engine.grammars.compile(grammar_spec(**options))
    eos = engine.tokenizer.eos_token_id
    cases = prompts(4, seed=len(grammar))
    references = {tuple(p): masked_greedy(tiny_model, p, compiled, 40, eos) for p in cases}
    for p, ref in references.items():  # the reference is itself grammatical: it parses once complete
        if ref[-1] == eos and grammar.startswith("json"):
            json.loads(engine.tokenizer.decode(ref[:-1]))
    proposers = {"none": "none", "suffix": "suffix", "ngram": "ngram",
                 "oracle": NoisyOracle(references, seed=1), "oracle-tree": NoisyOracle(references, seed=2, tree=True),
                 "random-tree": RandomProposer(seed=3, tree=True)}
    for name, proposer in proposers.items():
        for grammar_drafts in (True, False):
            tree = name.endswith("tree")
            results = engine.generate([list(p) for p in references], max_new_tokens=40, speculate=proposer, tree=tree,
                                      grammar_drafts=grammar_drafts, **options)
            for result, ref in zip(results, references.values()):
                assert result.token_ids == ref, (name, grammar_drafts)
            if name.startswith("oracle"):
                assert results[0].stats.accepted_tokens > 0


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects_and_forced_tokens_are_drafted(engine):
    compiled = engine.grammars.compile(grammar_spec(tools=BASH, tool_choice="required"))
    constraint = engine.grammars.constraint(compiled)
    encode = engine.tokenizer.encode
    good = encode("<tool_call>\n{")
    cut = constraint.prepare(Proposal.chain(encode("<tool_cell"), source="suffix"), budget=64, forced=False)
    assert cut.proposal.token_ids == encode("<tool_c") and cut.forced == 0  # cut at the first rejected token
    assert cut.masks.shape[0] == 1 + len(cut.proposal)  # one mask per state of the pass over it
    assert constraint.prepare(Proposal.chain(good + encode("<"), source="suffix"), 64, False).proposal.token_ids == good
    # with grammar drafts: the rest of the forced text (the call's fixed head for the only tool) follows the draft
    drafted = constraint.prepare(Proposal.chain(good, source="suffix"), budget=64, forced=True)
    chain = drafted.proposal  # compact JSON: the only property's key is forced too
    assert engine.tokenizer.decode(chain.token_ids) == '<tool_call>\n{"name": "bash", "arguments": {"command": "'
    spaced = engine.grammars.constraint(engine.grammars.compile(grammar_spec(tools=BASH, tool_choice="required",
                                                                             compact=False)))
    free = spaced.prepare(Proposal.chain(good, source="suffix"), budget=64, forced=True).proposal
    assert engine.tokenizer.decode(free.token_ids) == '<tool_call>\n{"name": "bash", "arguments": {'
    assert drafted.forced == len(chain) - len(good) > 0 and chain.source == "suffix"
    assert drafted.masks.shape[0] == 1 + len(chain)
    # routed to a prefix, the pass takes the masks of that prefix's states
    assert torch.equal(drafted.routed([0, 1]), drafted.masks[:3])
    # the forced tokens are each the only one the mask of their state allows, as are the drafted ones here
    for j, token in enumerate(chain.token_ids):
        assert (drafted.masks[j, token // 32] >> (token % 32)) & 1
    # a tree keeps its allowed nodes and drops the subtree of a rejected one
    a, b, c = encode("<"), encode("x"), encode("t")
    tree = Proposal(a + b + c, [-1, 0, 0], [1.0] * 3, 3.0, "tree")
    kept = constraint.prepare(tree, budget=64, forced=True)
    assert kept.proposal.token_ids == a + c and kept.proposal.parents == [-1, 0] and kept.forced == 0
    assert kept.masks.shape[0] == 3 and constraint.matcher.find_jump_forward_string().startswith("<tool_call>")
    # every method left the matcher at the committed tokens: the whole call is still to come
    constraint.accept(encode('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'))


def test_grammar_forced_tokens_are_a_draft_source_of_their_own(engine):
    prompt = [5, 6, 7, 8]
    # n-gram drafts, which remember nothing across calls (the suffix cache would draft the second from the first)
    on = engine.generate(prompt, max_new_tokens=60, tools=BASH, tool_choice="required", speculate="ngram")
    off = engine.generate(prompt, max_new_tokens=60, tools=BASH, tool_choice="required", speculate="ngram",
                          grammar_drafts=False)
    none = engine.generate(prompt, max_new_tokens=60, tools=BASH, tool_choice="required", speculate="none")
    assert on.token_ids == off.token_ids == none.token_ids
    grammar = on.stats.by_source["grammar"]
    assert grammar.accepted_tokens >= 10 and grammar.accepted_tokens <= grammar.draft_tokens
    assert "grammar" not in off.stats.by_source and not none.stats.by_source
    assert on.stats.steps < off.stats.steps
    assert on.stats.accepted_tokens == sum(s.accepted_tokens for s in on.stats.by_source.values())
    assert on.text.startswith('<tool_call>\n{"name": "bash", "arguments": {')


def test_a_call_with_tools_returns_its_parsed_tool_calls(engine):
    result = engine.generate([7, 8, 9], max_new_tokens=60, tools=BASH,
                             tool_choice={"type": "function", "function": {"name": "bash"}})
    if result.finish_reason == "eos":
        assert [c["function"]["name"] for c in result.tool_calls] == ["bash"]
        assert isinstance(json.loads(result.tool_calls[0]["function"]["arguments"]), dict)
    plain = engine.generate([7, 8, 9], max_new_tokens=8)
    assert plain.tool_calls is None


@pytest.mark.parametrize("options, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(tools=BASH, tool_choice={"type": "function", "function": {"name": "python"}}), "tool_choice"),
    (dict(tools=BASH, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": 'x", "arguments": {}}'}}]), "tools[0].function.name"),
    (dict(tools=BASH, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
])
def test_bad_grammars_name_their_field(engine, options, param):
    with pytest.raises(InvalidParameter) as error:
        engine.generate([5, 6], max_new_tokens=4, **options)
    assert error.value.param == param


# ---------------------------------------------------------------------------------------------------------------
# sampling under a grammar keeps the masked target distribution

# On the 8-token vocabulary (<unk> <|im_start|> <|im_end|> ' ' '!' '"' '#' '$'): a JSON string of '!', '#', '$'.
# Its opening quote is forced, then three tokens are allowed, then four (the closing quote too).
PATTERN = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "^[!#$]+$"}}}


def exact_masked_distribution(model, prompt: list[int], compiled, depth: int, top_k: int = 0) -> dict[tuple, float]:
    """P(first `depth` tokens) under plain constrained sampling at temperature 1: at each prefix the softmax of the
    masked logits (their top_k only, where given: top-k applies after the mask, as in plain constrained sampling)."""
    dist: dict[tuple, float] = {}

    def expand(prefix: tuple, p: float) -> None:
        if len(prefix) == depth or (prefix and prefix[-1] == 2):
            dist[prefix] = p
            return
        matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, SMALL_VOCAB)
        for t in prefix:
            assert matcher.accept_token(t)
        matcher.fill_next_token_bitmask(mask)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double().clone()
        allowed = torch.tensor([(int(mask[0, 0]) >> t) & 1 for t in range(SMALL_VOCAB)]) == 1
        logits = logits.masked_fill(~allowed, float("-inf"))
        if top_k:
            kth = logits.topk(min(top_k, int(allowed.sum()))).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        for t in range(SMALL_VOCAB):
            if probs[t] > 0:
                expand(prefix + (t,), p * float(probs[t]))

    expand((), 1.0)
    return dist


@pytest.fixture(scope="module")
def small_vocab_engine():
    model = tiny_llama(vocab_size=SMALL_VOCAB, seed=3, init_std=0.2)
    return Engine(TargetModel(model), tiny_tokenizer(SMALL_VOCAB), router=lambda ps, cs: list(ps)), model


class GrammarSamplingProposer(SamplingProposer):
    """SamplingProposer's drafts over three tokens, so that they cross the forced quote and the free choices. Sampled
    drafts put half their mass on ' ' (which the grammar rejects after the quote) and most of the rest on '#': a
    draft cut at a rejected token instead of redrawn would then shift the output towards '#' measurably."""

    BIAS = torch.tensor([-9.0, -9.0, -9.0, 3.0, 0.0, 0.0, 3.0, 0.0])

    def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
        if tree:
            return super().speculate(request_id, num_speculative_tokens, tree=True)
        n = min(3, num_speculative_tokens)
        if not self.with_logits:
            first, second = super().speculate(request_id, 2), super().speculate(request_id, 1)
            return Proposal((first.token_ids + second.token_ids)[:n], [-1, 0, 1][:n], [1.0] * n, float(n), "det")
        logits = self.BIAS + 0.5 * torch.randn(n, SMALL_VOCAB, generator=self.gen)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=self.gen)[:, 0].tolist()
        return Proposal(tokens, [-1, 0, 1][:n], [0.5] * n, 0.5 * n, "model", draft_logits=logits)


@pytest.mark.parametrize("tree, with_logits, top_k", [(False, False, 0), (True, False, 0), (False, True, 0),
                                                       (False, True, 3)])
def test_sampling_under_a_grammar_keeps_the_masked_target_distribution(small_vocab_engine, tree, with_logits, top_k):
    engine, model = small_vocab_engine
    prompt = [3, 5, 4, 6]
    compiled = engine.grammars.compile(grammar_spec(response_format=PATTERN))
    # top-k applies to the masked logits, as plain constrained sampling applies it
    expected = exact_masked_distribution(model, prompt, compiled, depth=3, top_k=top_k)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-9)
    proposer = GrammarSamplingProposer(seed=21 + 2 * tree + with_logits, tree=tree, with_logits=with_logits)
    counts = Counter()
    for call in range(6):
        results = engine.generate([prompt] * 500, max_new_tokens=4, temperature=1.0, speculate=proposer, tree=tree,
                                  seed=1000 * call + 2 * tree + with_logits, response_format=PATTERN,
                                  top_k=top_k)
        for r in results:
            counts[tuple(r.token_ids[:3])] += 1
        assert results[0].stats.accepted_tokens > 0
    assert chi_square_p_value([counts.get(c, 0) for c in expected], list(expected.values())) > 1e-3
    assert set(counts) <= set(expected)  # nothing outside the grammar


def test_cutting_a_sampled_draft_would_skew_the_sample(small_vocab_engine):
    """The chi-square test has power here: a point mass (constrained greedy) is far from the masked distribution."""
    engine, model = small_vocab_engine
    prompt = [3, 5, 4, 6]
    compiled = engine.grammars.compile(grammar_spec(response_format=PATTERN))
    expected = exact_masked_distribution(model, prompt, compiled, depth=3)
    greedy = tuple(engine.generate(prompt, max_new_tokens=3, response_format=PATTERN).token_ids[:3])
    assert greedy in expected
    assert chi_square_p_value([3000 * (c == greedy) for c in expected], list(expected.values())) < 1e-6


def test_a_session_with_tools_renders_them_and_extends_its_tokens_turn_after_turn(engine):
    session = engine.session(system="You run commands.", tools=BASH, tool_choice="required", max_new_tokens=80)
    first = session.send("List the files.")
    prompt = engine.tokenizer.decode(first.prompt_token_ids)
    assert '"name": "bash"' in prompt and "<tools>" in prompt  # the tools are in the prompt (the ChatML tools template)
    assert first.text.startswith('<tool_call>\n{"name": "bash", "arguments": {')
    call_id = first.tool_calls[0]["id"] if first.tool_calls else "call_0"
    before = list(session.tokens)
    second = session.send({"role": "tool", "tool_call_id": call_id, "content": "a.txt b.txt"})
    assert second.prompt_token_ids[:len(before)] == before  # the conversation's exact tokens, then the new turn
    assert second.stats.cached_tokens >= len(before) - 1


def test_greedy_steps_on_the_int8_head_take_the_grammars_maximum(tiny_model, tiny_tokenizer):
    """Where the CPU runs the product kernel a small greedy pass runs `GreedyHead`, which takes the masks itself:
    constrained greedy is still the reference's."""
    from hybridspec.model.head import GreedyHead

    target = TargetModel(tiny_model)
    target.greedy_head = GreedyHead(tiny_model.get_output_embeddings().weight)
    engine = Engine(target, tiny_tokenizer, router=lambda proposals, contexts: list(proposals))
    compiled = engine.grammars.compile(grammar_spec(**GRAMMARS["json_schema"]))
    for p in prompts(3, seed=7):
        ref = masked_greedy(tiny_model, p, compiled, 30, engine.tokenizer.eos_token_id)
        for speculate in ("none", "suffix"):
            assert engine.generate(p, max_new_tokens=30, speculate=speculate, **GRAMMARS["json_schema"]).token_ids \
                == ref


def free_whitespace(text: str) -> list[str]:
    """Whitespace outside JSON strings other than the one space after `,` and `:` that `json.dumps` writes."""
    found, in_string, escaped = [], False, False
    for i, c in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
        elif c == '"':
            in_string = True
        elif c.isspace() and not (c == " " and i and text[i - 1] in ",:"):
            found.append(c)
    return found


@pytest.mark.parametrize("compact", [True, False])
def test_compact_json_has_no_free_whitespace_and_the_other_grammar_is_kept(engine, compact):
    prompt = [5, 6, 7, 8, 9]
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    for options in ({"tools": BASH, "tool_choice": "required"},
                    {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}):
        texts = [engine.generate(prompt + [10 + seed], max_new_tokens=60, temperature=1.0, seed=seed,
                                 compact_json=compact, **options).text for seed in range(6)]
        if "tools" in options:
            texts = [t.split('"arguments": ', 1)[1].rsplit("}\n</tool_call>", 1)[0] for t in texts if "arguments" in t]
        spaces = [c for t in texts for c in free_whitespace(t)]
        assert texts and bool(spaces) != compact, (options, texts)  # a random model spends tokens on it where free


class DeadEnd:
    """A matcher at a state that allows no token at all (a schema that cannot be completed, found as it is reached)."""

    def fill_next_token_bitmask(self, masks, row: int = 0) -> bool:
        masks[row].zero_()
        return True

    def is_terminated(self) -> bool:
        return False

    def accept_token(self, token: int) -> bool:
        return False

    def rollback(self, n: int) -> None:
        pass


@pytest.mark.parametrize("tree", [False, True])
def test_a_grammar_that_allows_nothing_ends_its_call_with_an_error_naming_the_field(tree):
    from hybridspec.grammar.constraint import Constraint

    constraint = Constraint(DeadEnd(), 64, lambda text: [], param="tools")
    proposal = Proposal(token_ids=[5, 6], parents=[-1, -1], probs=[1.0, 1.0], score=2.0) if tree else \
        Proposal.chain([5, 6])
    with pytest.raises(InvalidParameter, match="allows nothing more") as e:
        constraint.prepare(proposal, budget=4, forced=True)
    assert e.value.param == "tools"
