"""Automatic prefix caching and concurrent callers, on a tiny random Llama.

Prefix caching never changes outputs (greedy tokens identical with the cache on and off over random prompts that share
random prefixes, cut mid-prompt and mid-response, alone and in batches; seeded sampling draws the same tokens), runs
only the uncached tokens, stays under its byte budget, and lets the suffix cache continue an earlier request without
`extends=`. Several threads sharing one Engine get exactly what each would get alone, a cancelled stream included,
and their decode steps share passes of the target (continuous batching).
"""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from hybridspec.runtime.engine import Engine
from hybridspec.runtime.prefill import KV_HEADROOM_TOKENS
from hybridspec.model.kv_cache import KVCache
from hybridspec.runtime.prefix_cache import KV_SLACK, PrefixCache
from hybridspec.proposal import Proposal
from hybridspec.model.target import TargetModel

VOCAB = 128
KV_BYTES_PER_TOKEN = 6 * 2 * 2 * 16 * 4  # tiny_llama: 6 layers, keys + values, 2 KV heads of 16 dims, float32


def make_engine(tiny_model, tiny_tokenizer, **kwargs) -> Engine:
    return Engine(TargetModel(tiny_model), tiny_tokenizer, **kwargs)


@pytest.fixture(scope="module")
def uncached(tiny_model, tiny_tokenizer):
    return make_engine(tiny_model, tiny_tokenizer, prefix_cache_bytes=0)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def conversation_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts as an agent's calls make them: each one begins with an earlier prompt cut at a random point (often its
    whole length, as a re-sent conversation) followed by new tokens; generate() adds responses to the mix below."""
    rng = random.Random(seed)
    prompts = [tokens(rng, rng.randint(5, 40))]
    for _ in range(n - 1):
        base = rng.choice(prompts)
        cut = len(base) if rng.random() < 0.5 else rng.randint(1, len(base))
        prompts.append(base[:cut] + tokens(rng, rng.randint(1, 20)))
    return prompts


@pytest.mark.parametrize("speculate", ["none", "suffix"])
def test_prefix_cache_never_changes_greedy_outputs(tiny_model, tiny_tokenizer, uncached, speculate):
    """Stateless calls that re-send earlier prompts + (part of) their responses + new tokens, one at a time and in
    batches: the same tokens as with the cache off, and fewer tokens prefilled."""
    engine = make_engine(tiny_model, tiny_tokenizer)
    rng = random.Random(7)
    history: list[list[int]] = []  # prompt + response of every call so far
    prefilled = prompt_tokens = 0
    for step, prompt in enumerate(conversation_prompts(seed=3, n=24)):
        if history and rng.random() < 0.6:  # continue an earlier call after its response, cut anywhere in it
            earlier = rng.choice(history)
            prompt = earlier[:rng.randint(len(earlier) // 2, len(earlier))] + tokens(rng, rng.randint(1, 6))
        if step % 6 == 5:  # a batch of continuations of the last calls
            batch = [h + tokens(rng, 3) for h in history[-3:]]
            got = engine.generate(batch, max_new_tokens=12, speculate=speculate)
            want = uncached.generate(batch, max_new_tokens=12, speculate="none")
            assert [r.token_ids for r in got] == [r.token_ids for r in want]
            history += [p + r.token_ids for p, r in zip(batch, got)]
            continue
        got = engine.generate(prompt, max_new_tokens=12, speculate=speculate)
        want = uncached.generate(prompt, max_new_tokens=12, speculate="none")
        assert got.token_ids == want.token_ids, step
        history.append(prompt + got.token_ids)
        prefilled += got.stats.prefill_tokens
        prompt_tokens += got.stats.prompt_tokens
    assert engine.prefix_cache.counters["hits"] > 10
    assert prefilled < prompt_tokens / 2


def test_a_continued_call_runs_only_its_new_tokens(tiny_model, tiny_tokenizer, uncached):
    engine = make_engine(tiny_model, tiny_tokenizer)
    prompt = tokens(random.Random(1), 30)
    first = engine.generate(prompt, max_new_tokens=10, speculate="none")
    assert first.stats.prefill_tokens == len(prompt) - 1
    follow = prompt + first.token_ids + [5, 6, 7]
    second = engine.generate(follow, max_new_tokens=10, speculate="none")
    assert second.stats.prefill_tokens == 3  # the response's last token (never run) and the new ones, less the last
    assert 0 < second.stats.prefill_s < second.stats.first_token_s < second.stats.total_s
    assert second.token_ids == uncached.generate(follow, max_new_tokens=10, speculate="none").token_ids
    # the same prompt again: all of it is cached but the last token, which is the first step's input
    again = engine.generate(follow, max_new_tokens=10, speculate="none")
    assert again.stats.prefill_tokens == 0 and again.token_ids == second.token_ids


def test_a_continued_call_grows_no_cache(tiny_model, tiny_tokenizer, uncached):
    """A call's cache has slack (KV_SLACK): an agent's next call, a few tokens longer, continues the same storage
    instead of copying all its KV into a larger one."""
    engine = make_engine(tiny_model, tiny_tokenizer)
    prompt = tokens(random.Random(3), 40)
    first = engine.generate(prompt, max_new_tokens=8, speculate="none")
    (entry,) = [e for e in engine.prefix_cache._entries.values() if e.cache is not None]
    storage, capacity = entry.cache.keys.data_ptr(), entry.cache.capacity
    assert capacity >= (len(prompt) + 8 + KV_HEADROOM_TOKENS) * (1 + KV_SLACK) - 1
    follow = prompt + first.token_ids + tokens(random.Random(4), 5)
    second = engine.generate(follow, max_new_tokens=8, speculate="none")
    (entry,) = [e for e in engine.prefix_cache._entries.values() if e.cache is not None]
    assert entry.cache.keys.data_ptr() == storage and entry.cache.capacity == capacity
    assert second.token_ids == uncached.generate(follow, max_new_tokens=8, speculate="none").token_ids


def test_a_grown_cache_keeps_its_tokens_and_zeroes_the_new_slots():
    cache = KVCache(2, 1, 2, 4, 5, torch.float32)
    with torch.inference_mode():
        cache.keys.fill_(float("nan"))
        cache.values.normal_()
    keys, values = cache.keys.clone(), cache.values.clone()
    cache.reserve(9, exact=True)
    assert cache.capacity == 9
    assert torch.equal(cache.values[..., :5, :], values) and torch.equal(cache.keys[..., :5, :].isnan(), keys.isnan())
    assert not cache.keys[..., 5:, :].any() and not cache.values[..., 5:, :].any()


def test_a_prompt_that_diverges_one_token_before_the_end(tiny_model, tiny_tokenizer, uncached):
    engine = make_engine(tiny_model, tiny_tokenizer)
    prompt = tokens(random.Random(2), 25)
    done = engine.generate(prompt, max_new_tokens=8, speculate="suffix")
    cached = prompt + done.token_ids
    diverging = cached[:-2] + [(cached[-2] + 1) % VOCAB or 3, cached[-1]]
    result = engine.generate(diverging, max_new_tokens=8, speculate="suffix")
    assert result.stats.prefill_tokens == 1  # everything up to the changed token was reused
    assert result.token_ids == uncached.generate(diverging, max_new_tokens=8, speculate="none").token_ids


def test_memory_stays_under_the_budget_and_evicted_prefixes_recompute(tiny_model, tiny_tokenizer, uncached):
    budget = 200 * KV_BYTES_PER_TOKEN  # a few requests' worth
    engine = make_engine(tiny_model, tiny_tokenizer, prefix_cache_bytes=budget)
    rng = random.Random(4)
    first_prompt = tokens(rng, 30)
    first = engine.generate(first_prompt, max_new_tokens=8, speculate="suffix")
    for i in range(30):  # a long run of unrelated calls pushes the first one out
        engine.generate(tokens(rng, rng.randint(10, 60)), max_new_tokens=rng.randint(1, 16), speculate="suffix")
        pool = engine.prefix_cache
        assert pool.nbytes <= budget
        assert pool.nbytes == sum(e.cache.nbytes for e in pool._entries.values() if e.cache is not None)
    assert engine.prefix_cache.counters["evicted_bytes"] > 0
    follow = first_prompt + first.token_ids + [9, 9]
    after = engine.generate(follow, max_new_tokens=8, speculate="suffix")
    assert after.stats.prefill_tokens == len(follow) - 1  # its KV was evicted: prefilled again, and right
    assert after.token_ids == uncached.generate(follow, max_new_tokens=8, speculate="none").token_ids
    again = engine.generate(follow + after.token_ids + [4], max_new_tokens=8, speculate="suffix")
    assert again.stats.prefill_tokens == 1  # cached again: only the response's last token runs


def test_the_suffix_cache_continues_an_extended_request_without_extends(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    prompt = tokens(random.Random(5), 40)
    first = engine.generate(prompt, max_new_tokens=10)
    before = engine.suffix_cache.stats()
    engine.generate(prompt + first.token_ids + [7, 8, 9], max_new_tokens=10)
    after = engine.suffix_cache.stats()
    assert after["session_hits"] == before["session_hits"] + 1
    # a prompt that does not extend it is indexed afresh
    engine.generate(prompt[:20] + [7], max_new_tokens=4)
    assert engine.suffix_cache.stats()["session_hits"] == after["session_hits"]


def test_seeded_sampling_draws_the_same_tokens_with_the_cache(tiny_model, tiny_tokenizer):
    # A seeded call's draws depend on what was drafted, so both engines get the same history (their suffix caches
    # propose alike) and the built-in cost tables (a measured table decides drafts by this machine's timings).
    cached, uncached = (make_engine(tiny_model, tiny_tokenizer, verify_cost=None, prefix_cache_bytes=b)
                        for b in (None, 0))
    prompt = tokens(random.Random(6), 30)
    first = [e.generate(prompt, max_new_tokens=10, temperature=0.8, seed=1) for e in (cached, uncached)]
    assert first[0].token_ids == first[1].token_ids
    follow = prompt + first[0].token_ids + [11, 12]
    drafted = 0
    for seed in range(4):
        got = cached.generate(follow, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=seed)
        want = uncached.generate(follow, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=seed)
        assert got.stats.prefill_tokens < len(follow) - 1
        assert got.token_ids == want.token_ids
        drafted += got.stats.draft_tokens
    assert drafted > 0  # the draws went through verification, not only plain steps


def test_sessions_and_streams_use_the_prefix_cache(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    session = engine.session(system="sys", max_new_tokens=10)
    session.send("hello")
    reply = session.send("again")
    assert reply.stats.prefill_tokens < reply.stats.prompt_tokens // 2
    prompt = list(session.tokens) + [20, 21]
    streamed = "".join(engine.stream(prompt, max_new_tokens=10))
    assert engine.prefix_cache.counters["hits"] >= 2
    assert streamed == make_engine(tiny_model, tiny_tokenizer, prefix_cache_bytes=0).generate(
        prompt, max_new_tokens=10).text


def test_prefix_cache_entries():
    """The pool itself: longest prefix, never the last token, supersession, take and store, LRU eviction."""
    def cache_of(n: int) -> KVCache:
        c = KVCache(1, 1, 1, 2, n, torch.float32)
        c.lengths[0] = n - 1
        return c

    pool = PrefixCache(budget_bytes=3 * cache_of(10).nbytes)
    pool.store("a", list(range(10)), cache_of(10))
    m = pool.match(list(range(10)))
    assert m.length == 9 and m.extends == "a" and m.extends_length == 10
    assert pool.match(list(range(5)) + [99]).length == 5
    assert pool.match(list(range(4))).length == 3  # the last token is a step's input, never cached
    assert pool.match([99, 1, 2]).length == 0
    pool.store("b", list(range(12)), cache_of(12))  # extends a: a's KV is superseded, its tokens stay
    assert len(pool) == 1 and pool.match(list(range(11)) + [0]).extends == "a"
    taken = pool.take(pool.match(list(range(12)) + [5]))
    assert pool.nbytes == 0 and pool.match(list(range(12))).length == 0
    pool.store("c", list(range(12)), taken)
    for i, rid in enumerate("defg"):
        pool.store(rid, [50 + i] * 10, cache_of(10))
        assert pool.nbytes <= pool.budget_bytes
    assert pool.match(list(range(12)) + [5]).length == 0  # c was least recently used: evicted
    assert pool.match([53] * 10 + [1]).length == 9
    with pytest.raises(ValueError, match="one-row cache"):
        pool.store("h", [1, 2, 3], cache_of(10))


# ---------------------------------------------------------------------------------------------------------------
# concurrent callers


def test_concurrent_callers_get_what_they_would_alone(tiny_model, tiny_tokenizer, uncached):
    """Six threads on one engine (generate, batches and streams of mixed lengths; one stream cancelled mid-way) get
    the tokens they get alone; afterwards nothing is live and the pool is consistent."""
    engine = make_engine(tiny_model, tiny_tokenizer)
    rng = random.Random(8)
    shared = tokens(rng, 20)  # a system prompt several callers share
    jobs = [(shared + tokens(rng, rng.randint(1, 30)), rng.choice([4, 16, 40]), speculate)
            for speculate in ["suffix", "none", "suffix", "ngram", "suffix", "none"]]
    want = [uncached.generate(p, max_new_tokens=n, speculate="none").token_ids for p, n, _ in jobs]
    got: dict[int, object] = {}
    start = threading.Barrier(len(jobs) + 1)

    def caller(i: int) -> None:
        prompt, n, speculate = jobs[i]
        start.wait()
        for turn in range(2):  # a second call continues the first, as an agent's next call does
            if i == 1:
                got[i] = engine.generate([prompt, prompt[:5]], max_new_tokens=n, speculate=speculate)[0].token_ids
            elif i == 2:
                stream = engine.stream(prompt, max_new_tokens=n, speculate=speculate)
                got[i] = [next(stream), next(stream)]
                stream.close()  # cancelled mid-way
                return
            else:
                got[i] = engine.generate(prompt, max_new_tokens=n, speculate=speculate).token_ids
            if turn == 0 and got[i] != want[i]:
                return
            prompt = prompt + got[i] + [3]
        got[i] = (got[i], prompt)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(timeout=300)
    assert len(got[2]) == 2 and all(got[2])  # the cancelled stream yielded its first deltas
    for i, (_, n, _) in enumerate(jobs):  # every other caller's second call equals an uncached run of its prompt
        if i == 2:
            continue
        assert isinstance(got[i], tuple), f"caller {i}'s first call differed from its solo run"
        second, follow = got[i]
        prompt_of_second = follow[:len(follow) - len(second) - 1]
        assert second == uncached.generate(prompt_of_second, max_new_tokens=n, speculate="none").token_ids
    assert engine.suffix_cache.stats()["live_requests"] == 0
    assert engine.prefix_cache.nbytes == sum(
        e.cache.nbytes for e in engine.prefix_cache._entries.values() if e.cache is not None)


def test_concurrent_calls_share_decode_steps(tiny_model, tiny_tokenizer, uncached):
    """Continuous batching: calls decoding at the same time are verified in the same passes of the target (fewer
    passes than steps), and a call whose proposer fails ends with its error while the others finish unharmed."""
    engine = make_engine(tiny_model, tiny_tokenizer)
    passes: list[int] = []
    step_many = engine.target.step_many

    def counting(batches, **kwargs):
        passes.append(len(batches))
        return step_many(batches, **kwargs)

    engine.target.step_many = counting

    class Failing:
        num_speculative_tokens, drafts_trees, prefers_trees, wants_target_features = 4, False, False, False

        def start_request(self, request_id, prompt, *, extends=None):
            self.steps = 0

        def append(self, request_id, tokens):
            pass

        def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
            self.steps += 1
            if self.steps == 5:
                raise RuntimeError("proposer broke")
            return Proposal.empty("failing")

        def finish_request(self, request_id):
            pass

        def abort_request(self, request_id):
            pass

    rng = random.Random(9)
    prompts = [tokens(rng, 12) for _ in range(4)]
    got: dict[int, object] = {}
    start = threading.Barrier(4)

    def caller(i: int) -> None:
        start.wait()
        try:
            speculate = Failing() if i == 3 else ("suffix" if i % 2 else "none")
            got[i] = engine.generate(prompts[i], max_new_tokens=30, speculate=speculate).token_ids
        except RuntimeError as e:
            got[i] = e

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert isinstance(got[3], RuntimeError) and "proposer broke" in str(got[3])
    for i in range(3):
        assert got[i] == uncached.generate(prompts[i], max_new_tokens=30, speculate="none").token_ids
    assert max(passes) >= 2  # some passes verified several calls at once
    assert engine.suffix_cache.stats()["live_requests"] == 0


def test_a_long_prompt_prefills_in_chunks_while_another_call_decodes(tiny_model, tiny_tokenizer, uncached):
    """Chunked prefill: a prompt that arrives while another call decodes runs `prefill_chunk` tokens per step in the
    passes that verify the other call's drafts, so that call keeps decoding meanwhile; both get their outputs alone."""
    engine = make_engine(tiny_model, tiny_tokenizer, prefill_chunk=8)
    passes: list[list[tuple[int, int]]] = []  # per pass: (prompt tokens, step rows) of each part
    step_many = engine.target.step_many

    def recording(inputs, **kwargs):
        passes.append([(len(i.prompt), len(i.last_tokens)) for i in inputs])
        return step_many(inputs, **kwargs)

    engine.target.step_many = recording
    rng = random.Random(4)
    short, long = tokens(rng, 6), tokens(rng, 90)
    decoding, got = threading.Event(), {}

    def first() -> None:
        stream = engine.stream(short, max_new_tokens=120, speculate="none")
        pieces = []
        for piece in stream:
            pieces.append(piece)
            if len(pieces) == 3:
                decoding.set()
        got["short"] = stream.result.token_ids

    def second() -> None:
        decoding.wait(timeout=60)
        got["long"] = engine.generate(long, max_new_tokens=20, speculate="suffix").token_ids

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got["short"] == uncached.generate(short, max_new_tokens=120, speculate="none").token_ids
    assert got["long"] == uncached.generate(long, max_new_tokens=20, speculate="suffix").token_ids
    chunks = [prompt for parts in passes for prompt, rows in parts if prompt]
    assert sum(chunks) == len(short) - 1 + len(long) - 1 and max(chunks) <= 8 and len(chunks) >= 12
    shared = [parts for parts in passes if any(p and not r for p, r in parts) and any(r and not p for p, r in parts)]
    assert len(shared) >= 5  # passes that ran a chunk of the long prompt and a decode step of the short call


@pytest.mark.parametrize("speculate", ["none", "suffix"])
def test_a_prompt_copies_what_a_running_call_ran_of_the_same_tokens(tiny_model, tiny_tokenizer, uncached, speculate):
    """In-flight prefix sharing: a call that begins while another call runs (nothing in the prefix cache yet) copies
    the KV of the prompt tokens the two share from that call's cache and runs only the rest; outputs are those of
    each call alone (a drafter's: tests/test_engine_drafters.py)."""
    engine = make_engine(tiny_model, tiny_tokenizer, prefill_chunk=8, prefix_cache_bytes=0)  # shared in flight only
    rng = random.Random(11)
    system = tokens(rng, 60)
    first, second = system + tokens(rng, 10), system + tokens(rng, 7)
    a = engine.stream(first, max_new_tokens=200, speculate=speculate, ignore_eos=True)
    a_text = next(a)  # a runs its whole prompt (no one else is running)
    with engine.loop.paused():  # b is in line before a's next step: a is live when b begins
        assert not a.ended
        b = engine.stream(second, max_new_tokens=12, speculate=speculate)
    b_text = "".join(b)
    assert not a.ended
    a_text += "".join(a)
    assert a.result.token_ids == uncached.generate(first, max_new_tokens=200, speculate=speculate,
                                                   ignore_eos=True).token_ids
    assert b.result.token_ids == uncached.generate(second, max_new_tokens=12, speculate=speculate).token_ids
    assert a_text == a.result.text and b_text == b.result.text
    assert b.result.stats.prefill_tokens == len(second) - 1 - len(system)
    assert b.result.stats.cached_tokens == len(system)


def step_together(engine: Engine, uncached: Engine, prompts: list[list[int]], speculate: str):
    """Submit a call per prompt while the engine's loop is held, so that they begin together (in this order) and step
    together to the end, each pass's parts recorded as (prompt tokens, step rows); asserts every call's output is its
    prompt's alone. Returns the calls' results and the passes."""
    passes = []
    step_many = engine.target.step_many

    def recording(inputs, **kwargs):
        passes.append([(len(i.prompt), len(i.last_tokens)) for i in inputs])
        return step_many(inputs, **kwargs)

    engine.target.step_many = recording
    with engine.loop.paused():
        handles = [engine.stream(p, max_new_tokens=6, speculate=speculate) for p in prompts]
    results = [h.wait()[0] for h in handles]
    for result, prompt in zip(results, prompts):
        assert result.token_ids == uncached.generate(prompt, max_new_tokens=6, speculate=speculate).token_ids
    return results, passes


def test_a_call_waits_for_an_earlier_call_running_the_same_prompt_tokens(tiny_model, tiny_tokenizer, uncached):
    """Two calls with a long shared prompt prefix that begin together: the later one skips the passes in which the
    earlier one runs the shared positions and copies them after; the shared tokens run once."""
    engine = make_engine(tiny_model, tiny_tokenizer, prefill_chunk=8)
    rng = random.Random(12)
    system = tokens(rng, 40)
    prompts = [system + tokens(rng, 5), system + tokens(rng, 9)]
    results, passes = step_together(engine, uncached, prompts, "none")
    passes = [[prompt for prompt, _ in parts] for parts in passes]
    assert passes[0] == [8]  # the later call waited while the earlier one ran the first shared chunk
    ran = sum(n for pass_ in passes for n in pass_)
    assert ran == sum(len(p) - 1 for p in prompts) - len(system)  # the shared positions ran once
    assert results[1].stats.cached_tokens == len(system)


class Pending:
    """A stand-in call for `Prefill.allot`: its pending prompt only (identity, not equality, tells calls apart)."""

    def __init__(self, pending: int | None) -> None:
        self.pending_prompt = None if pending is None else [7] * pending


@pytest.mark.parametrize("pending, expected", [
    ([100], [16]),  # alone: the whole step's share
    ([100, 3, 300], [8, 3, 5]),  # the oldest half, the shortest next, the rest to the next shortest
    ([5, 100], [5, 11]),  # an oldest prompt that needs less leaves the rest to the others
    ([100, 2, None], [14, 2, 0]),  # what the others leave goes back to the oldest; a decoding call gets none
    ([40, 40, 40], [8, 8, 0]),  # equal prompts: the older first
    ([None, None], [0, 0]),
])
def test_a_step_s_prompt_tokens_go_half_to_the_oldest_then_shortest_first(pending, expected):
    from hybridspec.runtime.prefill import Prefill

    calls = [Pending(n) for n in pending]  # oldest first
    prefill = Prefill(None, None, prefill_chunk=16, drafter_context=0)
    assert prefill.allot(calls) == expected
    assert sum(prefill.allot(calls[::-1])) == min(16, sum(n or 0 for n in pending))


def test_a_short_prompt_does_not_wait_for_a_long_cold_one(tiny_model, tiny_tokenizer, uncached):
    """An agent's next call (a few uncached tokens) that arrives behind a long cold prompt decodes from the first
    pass, while the long prompt goes on taking most of each step's prompt tokens; outputs are each call's alone."""
    engine = make_engine(tiny_model, tiny_tokenizer, prefill_chunk=8)
    rng = random.Random(13)
    prompts = [tokens(rng, 81), tokens(rng, 4)]
    _, passes = step_together(engine, uncached, prompts, "suffix")
    assert sorted(passes[0]) == [(3, 1), (5, 0)]  # the short prompt and its first step; 5 of the long one's 80
    assert all(sum(p for p, _ in parts) <= 8 for parts in passes)
    assert sum(p for parts in passes for p, _ in parts) == 80 + 3


def test_calls_take_turns_step_by_step(tiny_model, tiny_tokenizer):
    """Two long calls started together finish close together: the loop steps both in every pass, whichever thread
    reads its deltas faster."""
    engine = make_engine(tiny_model, tiny_tokenizer)
    order: list[int] = []
    start = threading.Barrier(2)

    def caller(i: int) -> None:
        start.wait()
        for _ in engine.stream(tokens(random.Random(i), 10), max_new_tokens=40, speculate="none"):
            order.append(i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert len(order) > 40 and switches > len(order) / 4


def test_common_prefix_helper():
    from hybridspec.runtime.prefix_cache import common_prefix

    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([], dtype=np.int64), np.array([1])) == 0
