"""The suffix tree and SuffixCache against the brute-force reference, plus persistence, memory, bad input, threads."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridspec.suffix import SuffixCache, SuffixCacheFileError
from hybridspec.suffix._tree import SuffixTree
from suffix_reference import RefCache, RefCorpus, ref_speculate

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tokens(vocab: int, max_size: int):
    return st.lists(st.integers(0, vocab - 1), max_size=max_size)


@st.composite
def scenarios(draw):
    vocab = draw(st.integers(1, 6))     # up to 6 children: more than a sibling list keeps ranked (TOP)
    depth = draw(st.integers(1, 7))
    budget = draw(st.sampled_from([4, 12, 40, 10_000]))
    evict_per_call = draw(st.sampled_from([1, 3, 8, 1024]))
    index_prompts = draw(st.booleans())
    tail = draw(st.sampled_from([0, 3, 16]))
    ops = []
    for _ in range(draw(st.integers(1, 20))):
        kind = draw(st.sampled_from(["start", "append", "append", "append", "spec", "spec", "spec", "finish",
                                      "extend"]))
        ops.append((kind, draw(tokens(vocab, 12)), draw(st.integers(0, 10)), draw(st.booleans()),
                    draw(st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0])), draw(st.sampled_from([0.5, 1.0, 2.0])),
                    draw(st.integers(1, 12))))
    return vocab, depth, budget, evict_per_call, index_prompts, tail, ops


def run_against_reference(scenario) -> int:
    vocab, depth, budget, evict_per_call, index_prompts, tail, ops = scenario
    cache = SuffixCache(max_depth=depth, global_budget_tokens=budget, evict_per_call=evict_per_call,
                        index_prompts_globally=index_prompts, vocab_size=vocab, prompt_tail_tokens=tail)
    ref = RefCache(depth, budget, evict_per_call, index_prompts, tail)
    live, finished, compared, n = [], [], 0, 0
    for kind, toks, k, tree, min_prob, factor, nodes in ops:
        if kind == "start" or not live and kind != "extend":
            rid = f"r{n}"
            n += 1
            cache.start_request(rid, toks)
            ref.start_request(rid, toks)
            live.append(rid)
        elif kind == "extend" and finished:
            prev = finished.pop()
            ctx = ref.retained[prev]["ctx"]
            prompt = ctx + toks if k % 3 else toks + ctx     # mostly a real extension, sometimes not
            rid = f"r{n}"
            n += 1
            cache.start_request(rid, prompt, extends=prev)
            ref.start_request(rid, prompt, extends=prev)
            live.append(rid)
        elif kind == "append" and live:
            cache.append(live[-1], toks)
            ref.append(live[-1], toks)
        elif kind == "finish" and live:
            rid = live.pop(0)
            cache.finish_request(rid)
            ref.finish_request(rid)
            finished.append(rid)
        elif kind == "spec" and live:
            rid = live[k % len(live)]
            got = cache.speculate(rid, num_speculative_tokens=k, max_spec_factor=factor, min_token_prob=min_prob,
                                  tree=tree, max_tree_nodes=nodes)
            want = ref.speculate(rid, k, factor, 0.0, min_prob, tree, nodes)
            if k == 0:
                want = ([], [], [], 0.0, 0)
            assert (got.token_ids, got.parents, got.probs, got.score, got.match_len) == want, (kind, rid)
            compared += 1
        assert cache._global.n_tokens == ref.glob.n_tokens()
    cache._global.check()
    for s in cache._states():
        s.tree.check()
    return compared


@SETTINGS
@given(scenarios())
def test_cache_matches_reference(scenario):
    run_against_reference(scenario)


@SETTINGS
@given(st.integers(1, 3), st.integers(2, 6), st.lists(tokens(3, 40), min_size=1, max_size=4), tokens(3, 30),
       st.booleans())
def test_long_contexts_and_overlapping_copies(vocab, depth, responses, ctx, tree):
    """Contexts longer than the depth exercise the copy past max_depth, including copies overlapping the draft."""
    cache = SuffixCache(max_depth=depth, vocab_size=vocab)
    ref = RefCache(depth, 10**6, 1024)
    for i, r in enumerate(responses):
        for c in (cache, ref):
            c.start_request(i, [])
            c.append(i, [t % vocab for t in r])
            c.finish_request(i)
    periodic = ([t % vocab for t in ctx] * 3)[: 3 * depth + 2]
    for c in (cache, ref):
        c.start_request("q", periodic)
    for k in (1, 5, 16, 40):
        got = cache.speculate("q", num_speculative_tokens=k, max_spec_factor=4.0, tree=tree, max_tree_nodes=k)
        assert (got.token_ids, got.parents, got.probs, got.score, got.match_len) == ref.speculate(
            "q", k, 4.0, 0.0, 0.1, tree, k)


def test_drafts_run_past_max_depth():
    """After a long match the draft is not capped by the tree's depth: it keeps copying."""
    rng = np.random.default_rng(1)
    block = rng.integers(0, 1000, 500)
    cache = SuffixCache(max_depth=8)
    cache.start_request(0, np.concatenate([block, rng.integers(0, 1000, 50), block[:100]]))
    p = cache.speculate(0, num_speculative_tokens=32, max_spec_factor=4.0)
    assert p.token_ids == block[100:132].tolist()
    assert p.match_len == 8 and p.score == 32.0 and p.is_chain


def test_wide_nodes_under_eviction_match_reference():
    """A common token followed by many others makes a wide node whose counts eviction keeps lowering: the best
    children kept ranked at the front of its list must be found again, for the reference's drafts in path and tree
    mode."""
    rng = np.random.default_rng(7)
    depth, vocab, budget, per_call = 3, 40, 120, 8
    cache = SuffixCache(max_depth=depth, global_budget_tokens=budget, evict_per_call=per_call, vocab_size=vocab,
                        prompt_tail_tokens=0)
    ref = RefCache(depth, budget, per_call, prompt_tail=0)
    for i in range(30):
        prompt = rng.integers(1, vocab, 3).tolist()
        response = [t for _ in range(8) for t in (0, int(min(rng.zipf(1.3), vocab - 1)))]
        for c in (cache, ref):
            c.start_request(i, prompt)
        for t in response:
            # min prob 0: every child is drafted, so beyond the ranked front of the list; 0.05: the front decides
            for tree, min_prob in ((False, 0.0), (True, 0.0), (True, 0.05)):
                got = cache.speculate(i, num_speculative_tokens=4, max_spec_factor=4.0, min_token_prob=min_prob,
                                      tree=tree, max_tree_nodes=6)
                assert (got.token_ids, got.parents, got.probs, got.score, got.match_len) == ref.speculate(
                    i, 4, 4.0, 0.0, min_prob, tree, 6)
            for c in (cache, ref):
                c.append(i, [t])
        for c in (cache, ref):
            c.finish_request(i)
    assert cache.stats()["evicted_tokens"] > 0
    cache._global.check()


def test_saturated_ending_counts_stay_exact():
    """More sequences end in one token than a node's ending counter holds (15 bits): the probabilities of what follows
    that token are then recounted from its children, and stay exact while eviction lowers the true number."""
    n = 33_000
    cache = SuffixCache(max_depth=4, prompt_tail_tokens=0, global_budget_tokens=2 * n - 2000)
    for i in range(n):
        cache.start_request(i, [])
        cache.append(i, [1 + i % 5, 7])
        cache.finish_request(i)
    for i, response in enumerate([[7, 3], [7, 2], [7, 3]]):
        cache.start_request(n + i, [])
        cache.append(n + i, response)
        cache.finish_request(n + i)
    assert cache.stats()["evicted_tokens"] > 0
    glob = RefCorpus(4)
    for toks, start in cache._global.sequences():
        glob.seqs.append(toks.tolist())
        glob.starts.append(start)
    cache.start_request("q", [9, 7])
    for tree in (False, True):
        got = cache.speculate("q", num_speculative_tokens=4, max_spec_factor=4.0, tree=tree)
        want = ref_speculate([9, 7], glob, 4, 4, 4, 4.0, 0.0, 0.1, tree)
        assert (got.token_ids, got.parents, got.probs, got.score, got.match_len) == want
        assert got.token_ids[0] == 3 and got.probs[0] == 2 / 3
    cache._global.check()


def test_a_chain_follows_the_output_where_it_repeats_itself():
    cache = SuffixCache(max_depth=16)
    # the prompt has "1 2" followed by 3 three times; the output so far has "1 2" followed by 4, then "1 2" again
    cache.start_request(0, [1, 2, 3, 1, 2, 3, 1, 2, 3])
    cache.append(0, [1, 2, 4, 1, 2])
    got = cache.speculate(0, num_speculative_tokens=2)
    # the request's tree alone drafts 3 (3 of the 4 continuations of "1 2"); the output alone drafts 4, 1, surely
    assert got.token_ids == [4, 1] and got.probs == [1.0, 1.0] and got.match_len == 2
    # trees keep the union of the request's and the global tree's drafts, as before
    assert cache.speculate(0, num_speculative_tokens=2, tree=True).token_ids[0] == 3


def test_tree_mode_branches_and_respects_limits():
    cache = SuffixCache(max_depth=16)
    # "1 2" is followed by 3 twice and by 4 once
    cache.start_request(0, [1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2])
    p = cache.speculate(0, num_speculative_tokens=3, max_spec_factor=2.0, tree=True, max_tree_nodes=5,
                        min_token_prob=0.0)
    assert len(p) <= 5 and not p.is_chain
    assert p.token_ids[0] == 3 and abs(p.probs[0] - 2 / 3) < 1e-12
    assert 4 in p.token_ids and all(par < i for i, par in enumerate(p.parents))
    chain = cache.speculate(0, num_speculative_tokens=3, max_spec_factor=2.0)
    assert chain.token_ids[0] == 3 and chain.is_chain


def test_tree_mode_joins_the_request_and_global_drafts():
    """The request's own history continues "1 2 3" with 7 8, the global history with 4 5, both surely (score 2): a
    chain takes the request's (ties go to it), a tree holds both, and a path both sources drafted is one node."""
    cache = SuffixCache(max_depth=8)
    for i in range(3):
        cache.start_request(f"g{i}", [])
        cache.append(f"g{i}", [1, 2, 3, 4, 5, 9])
        cache.finish_request(f"g{i}")
    cache.start_request("q", [1, 2, 3, 7, 8, 0, 1, 2, 3])
    chain = cache.speculate("q", num_speculative_tokens=2)
    assert chain.token_ids == [7, 8] and chain.is_chain
    tree = cache.speculate("q", num_speculative_tokens=2, tree=True, max_tree_nodes=8)
    paths = {tuple(tree.token_ids[j] for j in _path(tree, i)) for i in range(len(tree))}
    assert paths == {(4,), (4, 5), (7,), (7, 8)} and tree.score == sum(tree.probs)
    assert tree.token_ids[:2] == [7, 8] and tree.probs == [1.0] * 4  # the request's draft ranks first
    small = cache.speculate("q", num_speculative_tokens=2, tree=True, max_tree_nodes=3)
    assert len(small) == 3 and all(p < i for i, p in enumerate(small.parents))  # cut by probability, still a tree
    cache.start_request("r", [1, 2, 3, 4, 5, 0, 1, 2, 3])  # both sources say 4 5: one path
    both = cache.speculate("r", num_speculative_tokens=2, tree=True, max_tree_nodes=8)
    assert both.token_ids == [4, 5] and both.parents == [-1, 0]


def test_tree_mode_backs_off_to_a_shorter_match_that_occurs_more_often():
    """[1 2 3] was followed once by 4, but [2 3] three more times by 6: a tree drafts both, a chain only 4."""
    cache = SuffixCache(max_depth=8, num_speculative_tokens=4)
    cache.start_request("q", [1, 2, 3, 4, 5, 2, 3, 6, 7, 2, 3, 6, 8, 2, 3, 6, 1, 2, 3])
    chain = cache.speculate("q", tree=False)
    assert chain.token_ids[0] == 4 and chain.is_chain and 6 not in chain.token_ids
    tree = cache.speculate("q", tree=True, max_tree_nodes=8)
    roots = {t: p for t, p, parent in zip(tree.token_ids, tree.probs, tree.parents) if parent == -1}
    assert roots == {4: 1.0, 6: 0.75}  # 4: the long match's (1/1), 6: the shorter one's (3 of its 4 continuations)
    assert tree.match_len == 3


def _path(proposal, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = proposal.parents[i]
    return out[::-1]


def test_session_indexes_only_new_tokens():
    cache = SuffixCache(max_depth=16)
    prompt = list(range(100))
    cache.start_request("t1", prompt)
    cache.append("t1", [7, 8, 9])
    cache.finish_request("t1")
    state_tree = cache._retained["t1"].tree
    cache.start_request("t2", prompt + [7, 8, 9] + [200, 201], extends="t1")
    assert cache._live["t2"].tree is state_tree            # taken over, not rebuilt
    assert cache._live["t2"].indexed_from == 103 and cache.stats()["session_hits"] == 1
    cache.append("t2", [1])
    cache.finish_request("t2")
    cache.start_request("t3", [5, 5, 5], extends="t2")     # not an extension: indexed afresh
    assert cache.stats()["session_misses"] == 1
    assert cache._live["t3"].length == 3


def test_global_budget_is_kept_under_a_long_run():
    rng = np.random.default_rng(0)
    budget, longest = 20_000, 2400
    cache = SuffixCache(max_depth=32, global_budget_tokens=budget, max_retained=4)
    worst = 0
    for i in range(300):
        cache.start_request(i, rng.integers(0, 5000, 200))
        for _ in range(4):
            cache.speculate(i)
            cache.append(i, rng.integers(0, 5000, int(rng.integers(1, longest // 4))))
            assert cache.stats()["global_tokens"] <= budget + longest
        cache.finish_request(i)
        worst = max(worst, cache.stats()["global_tokens"])
    assert worst <= budget
    assert cache.stats()["evicted_tokens"] > 0
    assert cache.bytes_per_token() < 120
    cache._global.check()


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    cache = SuffixCache(max_depth=12, global_budget_tokens=2950, evict_per_call=50)
    for i in range(20):
        cache.start_request(i, rng.integers(0, 50, 30))
        cache.append(i, rng.integers(0, 50, 200))
        cache.finish_request(i)
    assert cache._global.sequences()[0][1] > 0        # the oldest is partly evicted: that must survive too
    cache.start_request("q", rng.integers(0, 50, 40))
    path = tmp_path / "g.hsc"
    cache.save(path)
    other = SuffixCache(max_depth=12)
    other.load(path)
    other.start_request("q", cache._live["q"].tokens())
    assert [s[1] for s in other._global.sequences()] == [s[1] for s in cache._global.sequences()]
    for k in (4, 16):
        for tree in (False, True):
            a, b = cache.speculate("q", k, tree=tree), other.speculate("q", k, tree=tree)
            assert (a.token_ids, a.probs, a.parents) == (b.token_ids, b.probs, b.parents)
    other._global.check()


def test_damaged_files_are_rejected_and_leave_the_cache_untouched(tmp_path):
    cache = SuffixCache(max_depth=8)
    for i in range(3):
        cache.start_request(i, [1, 2, 3])
        cache.append(i, [4, 5, 6, i])
        cache.finish_request(i)
    path = tmp_path / "g.hsc"
    cache.save(path)
    data = path.read_bytes()
    target = SuffixCache(max_depth=8)
    target.start_request("x", [9, 9])
    target.append("x", [1, 2, 3])
    target.finish_request("x")
    before = target._global.sequences()
    bad = tmp_path / "bad.hsc"
    for cut in range(len(data)):
        bad.write_bytes(data[:cut])
        with pytest.raises(SuffixCacheFileError):
            target.load(bad)
    rng = np.random.default_rng(0)
    for _ in range(200):
        flipped = bytearray(data)
        i = int(rng.integers(len(data)))
        flipped[i] ^= 1 << int(rng.integers(8))
        bad.write_bytes(bytes(flipped))
        with pytest.raises(SuffixCacheFileError):
            target.load(bad)
    bad.write_bytes(b"{'some': 'json'}" * 10)
    with pytest.raises(SuffixCacheFileError, match="not a hybridspec"):
        target.load(bad)
    after = target._global.sequences()
    assert [s.tolist() for s, _ in after] == [s.tolist() for s, _ in before]
    # an interrupted save leaves no temp files behind and the old file intact
    assert sorted(os.listdir(tmp_path)) == ["bad.hsc", "g.hsc"]


def test_vocab_mismatch_on_load(tmp_path):
    cache = SuffixCache()
    cache.start_request(0, [1])
    cache.append(0, [900, 901])
    cache.finish_request(0)
    cache.save(tmp_path / "g")
    with pytest.raises(SuffixCacheFileError, match="out of range"):
        SuffixCache(vocab_size=500).load(tmp_path / "g")


def test_bad_input_raises_clear_errors():
    cache = SuffixCache(vocab_size=100)
    with pytest.raises(ValueError, match="out of range"):
        cache.start_request(0, [1, 100])
    with pytest.raises(ValueError, match="out of range"):
        cache.start_request(0, [-1])
    with pytest.raises(TypeError, match="integers"):
        cache.start_request(0, [1.5, 2.0])
    with pytest.raises(TypeError, match="integers"):
        cache.start_request(0, np.array([True, False]))
    with pytest.raises(ValueError, match="flat"):
        cache.start_request(0, [[1, 2]])
    assert cache.stats()["live_requests"] == 0            # nothing half-created
    with pytest.raises(KeyError, match="unknown request"):
        cache.append("nope", [1])
    with pytest.raises(KeyError, match="unknown request"):
        cache.speculate("nope")
    cache.start_request(0, [1, 2, 1, 2])
    with pytest.raises(ValueError, match="already running"):
        cache.start_request(0, [1])
    with pytest.raises(ValueError, match=">= 0"):
        cache.speculate(0, num_speculative_tokens=-1)
    with pytest.raises(TypeError):
        cache.speculate(0, num_speculative_tokens=2.5)
    with pytest.raises(ValueError, match="min_token_prob"):
        cache.speculate(0, min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_tree_nodes"):
        cache.speculate(0, tree=True, max_tree_nodes=0)
    assert len(cache.speculate(0, num_speculative_tokens=0)) == 0
    assert cache.speculate(0, num_speculative_tokens=None).token_ids == [1, 2]      # None: the cache default
    assert cache.speculate(0, num_speculative_tokens=1).token_ids == [1]
    for not_an_int in (True, 1.0):          # equal to the 1 just validated, and still rejected
        with pytest.raises(TypeError):
            cache.speculate(0, num_speculative_tokens=not_an_int)
    with pytest.raises(ValueError, match="has not finished"):
        cache.start_request(1, [1, 2, 1, 2, 3], extends=0)
    cache.finish_request(0)
    with pytest.raises(KeyError, match="has finished"):
        cache.append(0, [3])
    with pytest.raises(ValueError):
        SuffixCache(max_depth=0)
    with pytest.raises(ValueError):
        SuffixTree(70000)


def test_batch_matches_single_and_threads_are_safe():
    rng = np.random.default_rng(5)
    cache = SuffixCache(max_depth=16)
    base = rng.integers(0, 40, 400)
    for i in range(8):
        cache.start_request(i, base)
        cache.append(i, base[i * 10: i * 10 + 5])
    single = [cache.speculate(i) for i in range(8)]
    batch = cache.speculate_batch(range(8))
    assert [p.token_ids for p in batch] == [p.token_ids for p in single]
    assert any(len(p) for p in batch)

    # four threads drive their own requests on one shared cache; results equal a serial run
    def drive(c, rid, seed, out):
        r = np.random.default_rng(seed)
        c.start_request(rid, base[:200])
        for _ in range(60):
            out.append(tuple(c.speculate(rid).token_ids))
            c.append(rid, r.integers(0, 40, 3))
        c.finish_request(rid)

    shared = SuffixCache(max_depth=16)
    outs = {t: [] for t in range(4)}
    threads = [threading.Thread(target=drive, args=(shared, f"t{t}", t, outs[t])) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    shared._global.check()
    assert shared.stats()["finished_requests"] == 4 and all(len(o) == 60 for o in outs.values())
