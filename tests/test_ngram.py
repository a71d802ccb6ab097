"""NgramProposer against a brute-force reference, its request life cycle, and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.proposal import Proposal
from hybridspec.suffix import NgramProposer


def reference_draft(ctx: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """Longest n in [max_n..min_n] whose last n tokens occur earlier; its most recent occurrence; k tokens after."""
    L = len(ctx)
    for n in range(max_n, min_n - 1, -1):
        pattern = ctx[L - n:] if n <= L else None
        if pattern is None:
            continue
        for s in range(L - n - 1, -1, -1):  # occurrences that end before the context does, most recent first
            if ctx[s:s + n] == pattern:
                return ctx[s + n:s + n + k], n
    return [], 0


def check(p: Proposal, ctx: list[int], min_n: int, max_n: int, k: int) -> None:
    tokens, n = reference_draft(ctx, min_n, max_n, k)
    assert p.token_ids == tokens
    assert p.parents == list(range(-1, len(tokens) - 1))
    assert p.probs == [1.0] * len(tokens)
    assert p.score == float(len(tokens))
    assert p.source == "ngram"
    assert p.match_len == (n if tokens else 0)


# tiny vocabularies: many repeats, ties, overlaps and matches that reach the start of the context
tokens_st = st.integers(2, 4).flatmap(lambda vocab: st.lists(st.integers(0, vocab - 1), max_size=40))


@settings(max_examples=300, deadline=None)
@given(prompt=tokens_st, chunks=st.lists(tokens_st.map(lambda t: t[:6]), max_size=8),
       min_n=st.integers(1, 4), extra_n=st.integers(0, 4), k=st.integers(0, 12))
def test_matches_reference_with_incremental_appends(prompt, chunks, min_n, extra_n, k):
    max_n = min_n + extra_n
    prop = NgramProposer(min_n=min_n, max_n=max_n, num_speculative_tokens=k)
    prop.start_request("r", prompt)
    ctx = list(prompt)
    check(prop.speculate("r"), ctx, min_n, max_n, k)
    for chunk in chunks:
        prop.append("r", np.asarray(chunk, dtype=np.int64))
        ctx += chunk
        check(prop.speculate("r"), ctx, min_n, max_n, k)
        check(prop.speculate("r", num_speculative_tokens=3), ctx, min_n, max_n, 3)
    assert prop.context("r").tolist() == ctx


@settings(max_examples=100, deadline=None)
@given(first=tokens_st, response=tokens_st, new=tokens_st, mutate=st.booleans())
def test_extends_gives_the_same_drafts_as_a_fresh_start(first, response, new, mutate):
    prop = NgramProposer()
    prop.start_request("turn1", first)
    prop.append("turn1", response)
    prop.finish_request("turn1")
    prompt = first + response + new
    if mutate and prompt:  # not an extension any more: must fall back to the whole prompt
        prompt[0] = 7
    prop.start_request("turn2", prompt, extends="turn1")
    assert prop.context("turn2").tolist() == prompt
    check(prop.speculate("turn2"), prompt, prop.min_n, prop.max_n, prop.num_speculative_tokens)


def test_most_recent_occurrence_and_longest_n():
    prop = NgramProposer(min_n=2, max_n=4, num_speculative_tokens=3)
    # [1, 2] occurs twice before the end; the later occurrence is followed by 7 8 9, the earlier by 5 6
    prop.start_request("a", [1, 2, 5, 6, 1, 2, 7, 8, 9, 1, 2])
    p = prop.speculate("a")
    assert (p.token_ids, p.match_len) == ([7, 8, 9], 2)
    # a longer match beats a more recent shorter one: [3, 1, 2] only occurs first
    prop.start_request("b", [3, 1, 2, 5, 6, 0, 1, 2, 7, 3, 1, 2])
    p = prop.speculate("b")
    assert (p.token_ids, p.match_len) == ([5, 6, 0], 3)


def test_no_match_and_short_context_give_empty_proposals():
    prop = NgramProposer()
    prop.start_request("a", [])
    assert len(prop.speculate("a")) == 0
    prop.append("a", [1, 2, 3, 4])
    assert prop.speculate("a") == Proposal.empty(source="ngram")


def test_lifecycle_and_retention():
    prop = NgramProposer(max_retained=1)
    prop.start_request("a", [1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match="already active"):
        prop.start_request("a", [1])
    with pytest.raises(ValueError, match="has not finished"):
        prop.start_request("x", [1, 2, 3, 1, 2, 4], extends="a")
    prop.finish_request("a")
    for call in (lambda: prop.append("a", [1]), lambda: prop.speculate("a"), lambda: prop.finish_request("a"),
                 lambda: prop.abort_request("a")):
        with pytest.raises(KeyError, match="unknown request"):
            call()
    # retention is bounded: once "b" is retained, "a" is gone and extends="a" falls back to the full prompt
    prop.start_request("b", [4, 5])
    prop.finish_request("b")
    prop.start_request("c", [1, 2, 3, 1, 2, 3], extends="a")
    assert prop.context("c").tolist() == [1, 2, 3, 1, 2, 3]
    assert prop.speculate("c").token_ids == [1, 2, 3]
    prop.abort_request("c")
    with pytest.raises(KeyError):
        prop.speculate("c")
    prop.start_request("d", [4, 5, 6], extends="c")  # aborted requests are not retained
    assert prop.context("d").tolist() == [4, 5, 6]


def test_num_speculative_tokens_values():
    prop = NgramProposer(num_speculative_tokens=2)
    prop.start_request("a", [1, 2, 3, 4, 5, 1, 2])
    assert prop.speculate("a").token_ids == [3, 4]
    assert prop.speculate("a", num_speculative_tokens=None).token_ids == [3, 4]
    assert prop.speculate("a", num_speculative_tokens=10).token_ids == [3, 4, 5, 1, 2]
    assert prop.speculate("a", num_speculative_tokens=0) == Proposal.empty(source="ngram")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        prop.speculate("a", num_speculative_tokens=-1)
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        prop.speculate("a", num_speculative_tokens=2.5)


@pytest.mark.parametrize("bad, exc", [
    ([1.5, 2.0], TypeError),
    (["a", "b"], TypeError),
    ([True, False], TypeError),
    ([1, -1], ValueError),
    ([2**31], ValueError),
    ([[1, 2]], ValueError),
])
def test_bad_tokens_are_rejected(bad, exc):
    prop = NgramProposer()
    with pytest.raises(exc, match="token id"):
        prop.start_request("a", bad)
    prop.start_request("b", [1, 2])
    with pytest.raises(exc, match="token id"):
        prop.append("b", bad)
    assert prop.context("b").tolist() == [1, 2]  # a rejected append leaves the context untouched


@pytest.mark.parametrize("kwargs", [dict(min_n=0), dict(min_n=3, max_n=2), dict(num_speculative_tokens=-1),
                                    dict(max_retained=-1)])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        NgramProposer(**kwargs)


def test_long_context_grows_in_place():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 50, size=3000)
    prop = NgramProposer(min_n=3, max_n=6, num_speculative_tokens=8)
    prop.start_request("a", text[:100])
    for i in range(100, 3000, 7):
        prop.append("a", text[i:i + 7])
    ctx = text.tolist()
    assert prop.context("a").tolist() == ctx
    # re-emitting a span copies what followed it
    prop.append("a", text[1000:1010])
    check(prop.speculate("a"), ctx + text[1000:1010].tolist(), 3, 6, 8)
    assert prop.indexed_tokens() == len(ctx) + 10
    assert prop.memory_bytes() >= 4 * prop.indexed_tokens()
