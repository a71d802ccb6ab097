"""Gated DeltaNet (Qwen3.5's linear attention) under speculation: the recurrent state moves by exactly the kept tokens
in a step with no draft, a draft rejected at its first token, a partly accepted chain and a tree whose accepted path
is not its first branch; a prefix-cache hit exists only at an entry's end; memory is counted. The architecture's
token-for-token tests against transformers (every proposer, batched, chunked prefill, prefix hits) are in
tests/test_architectures.py."""
from __future__ import annotations

import functools

import pytest
import torch

from hybridspec.model.linear import KERNEL_ROWS
from hybridspec.model.target import TargetModel
from hybridspec.runtime.engine import Engine
from hybridspec.runtime.prefix_cache import PrefixCache
from hybridspec.tools.testing import tiny_causal_lm, tiny_tokenizer


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel(tiny_causal_lm("qwen3_5"))


def fresh(target: TargetModel, tokens: list[int]):
    """A cache that ran `tokens` as one prompt, and the logits after them."""
    cache = target.new_cache(1, 128)
    logits = target.prefill(cache, [tokens]).logits[0, -1]
    return cache, logits


def assert_same_state(target: TargetModel, cache, row: int, tokens: list[int]) -> None:
    """Row `row` holds `tokens`: its length, its conv and recurrent states, and the next step's logits are those of
    the same tokens run as a prompt."""
    reference, _ = fresh(target, tokens[:-1])
    assert cache.lengths[row] == len(tokens) - 1
    # a prompt and a step round differently (~1e-5); one token more or less moves the state by far more
    torch.testing.assert_close(cache.conv[:, row], reference.conv[:, 0], rtol=1e-3, atol=2e-4)
    torch.testing.assert_close(cache.state[:, row], reference.state[:, 0], rtol=1e-3, atol=2e-4)
    shorter, _ = fresh(target, tokens[:-2])
    assert (shorter.state[:, 0] - reference.state[:, 0]).abs().max() > 1e-2
    ours = target.step(cache, [tokens[-1] if r == row else 3 for r in range(cache.batch_size)]).logits[row, 0]
    theirs = target.step(reference, [tokens[-1]]).logits[0, 0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_every_kind_of_step_moves_the_state_by_the_kept_tokens(target):
    prompt = [5, 9, 17, 33, 8, 41, 12, 77, 6]
    cache = target.new_cache(2, 128)
    target.prefill(cache, [prompt, prompt[:5]])
    sequences = [prompt + [99], prompt[:5] + [98]]  # the last token of each: the next step's input
    steps = [
        # (drafts per row, parents per row, kept input slots per row)
        ([[], []], None, [[0], [0]]),  # no draft at all: the step is a plain decode step
        ([[20, 21, 22, 23], [30, 31]], None, [[0], [0]]),  # every draft token rejected
        ([[40, 41, 42], [50, 51, 52, 53]], None, [[0, 1, 2], [0, 1, 2, 3, 4]]),  # partly / fully accepted chains
        # trees: the accepted path runs through a later branch (slots 0, 3, 5 and 0, 2)
        ([[60, 61, 62, 63, 64], [70, 71, 72]], [[-1, 0, -1, 2, 3], [-1, -1, 1]], [[0, 3, 4, 5], [0, 2, 3]]),
    ]
    for drafts, parents, kept in steps:
        last = [s[-1] for s in sequences]
        target.step(cache, last, drafts, parents)
        for row, slots in enumerate(kept):
            inputs = [last[row]] + drafts[row]
            cache.commit(row, slots)
            sequences[row] += [inputs[s] for s in slots[1:]] + [99 - row]  # the next token: any
        for row in range(2):
            assert_same_state(target, cache.row(row), 0, sequences[row])


@pytest.mark.parametrize("shape", [(3, 4, 32, 48), (2, 16, 128, 128), (1, 2, 7, 16), (2, 2, 8, 12)])
def test_the_delta_step_is_the_rule_in_place_or_not(shape):
    """`delta_step` (the kernel where the CPU has AVX-512; value sizes it does not take by torch) is the reference
    rule, with each head's output by the query; in place it gives the same bits, and so it does on a row of a batch
    (strided states)."""
    from hybridspec.model.kv_cache import delta_step, delta_update

    rows, heads, key_dim, value_dim = shape
    gen = torch.Generator().manual_seed(sum(shape))
    state = torch.randn(rows, heads, key_dim, value_dim, generator=gen)
    key = torch.nn.functional.normalize(torch.randn(rows, heads, key_dim, generator=gen), dim=-1)
    value = torch.randn(rows, heads, value_dim, generator=gen)
    decay, beta = -torch.rand(rows, heads, generator=gen), torch.rand(rows, heads, generator=gen)
    query, output = torch.randn(rows, heads, key_dim, generator=gen), torch.empty(rows, heads, value_dim)
    new = delta_step(state, key, value, decay, beta, query=query, output=output)
    want = delta_update(state, key, value, decay, beta)
    torch.testing.assert_close(new, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(output, (want * query[..., None]).sum(-2), atol=1e-4, rtol=1e-5)
    in_place = state.clone()
    assert delta_step(in_place, key, value, decay, beta, in_place) is in_place and torch.equal(in_place, new)
    batch = torch.stack([state, state], dim=1)  # [rows, 2, ...]: row 1 of each, strided
    delta_step(batch[:, 1], key, value, decay, beta, batch[:, 1])
    assert torch.equal(batch[:, 1], new) and torch.equal(batch[:, 0], state)


def test_a_fully_accepted_chain_keeps_the_state_a_replay_gives(target):
    """A plain step or a fully accepted chain keeps the state its pass computed; a partly accepted one replays the
    kept nodes at commit. From one pass, the replay is bitwise the pass's own state; across passes of different
    lengths the same tokens reach bitwise the same state where the products compute each row alone (the AVX-512
    kernel), and the same within rounding where MKL's and oneDNN's products round a 3- and a 4-row pass apart."""
    prompt = [5, 9, 17, 33, 8, 41, 12, 77, 6]
    kept, replayed, forced = (target.new_cache(1, 64) for _ in range(3))
    for cache in (kept, replayed, forced):
        target.prefill(cache, [prompt])
    target.step(kept, [3], [[20, 21]])
    kept.commit(0, [0, 1, 2])  # the pass's last state
    target.step(replayed, [3], [[20, 21, 22]])
    replayed.commit(0, [0, 1, 2])  # node 3 rejected: replayed from the row's state
    target.step(forced, [3], [[20, 21]])
    forced.pending.chain_ends = [None] * len(forced.pending.chain_ends)
    forced.commit(0, [0, 1, 2])  # the same pass's nodes, replayed
    assert torch.equal(forced.state, kept.state) and torch.equal(forced.conv, kept.conv)
    same = torch.equal if KERNEL_ROWS >= 4 else functools.partial(torch.allclose, rtol=1e-4, atol=1e-4)
    assert same(kept.state, replayed.state) and same(kept.conv, replayed.conv)
    for cache in (kept, replayed):
        target.step(cache, [7])
        cache.commit(0, [0])
    assert same(kept.state, replayed.state)


def test_a_recurrent_cache_cannot_go_back_and_copies_only_whole_rows(target):
    cache, _ = fresh(target, [5, 6, 7, 8, 9])
    with pytest.raises(ValueError, match="cannot go back"):
        cache.truncate(0, 3)
    cache.truncate(0, 5)  # its own length: nothing to drop
    other = target.new_cache(1, 64)
    with pytest.raises(ValueError, match="recurrent state holds 5 tokens, not 3"):
        other.copy_prefix(0, cache, 0, 3)
    other.copy_prefix(0, cache, 0, 5)
    assert torch.equal(other.state, cache.state) and torch.equal(other.conv, cache.conv)


def test_a_prefix_hit_is_an_entry_end_only(target):
    """A prompt that extends a stored request continues its state; one that shares only part of it gets no hit (the
    state of a prefix is not kept), where attention-only models would reuse the shared part."""
    tokens = [5, 6, 7, 8, 9, 10, 11]
    pool = PrefixCache(1 << 30)
    cache, _ = fresh(target, tokens[:-1])
    pool.store("a", tokens, cache)
    assert pool.match(tokens + [12, 13]).length == len(tokens) - 1
    assert pool.match(tokens[:4] + [40, 41, 42]).length == 0
    llama = TargetModel(tiny_causal_lm("llama"))
    plain = PrefixCache(1 << 30)
    plain_cache = llama.new_cache(1, 64)
    llama.prefill(plain_cache, [tokens[:-1]])
    plain.store("a", tokens, plain_cache)
    assert plain.match(tokens[:4] + [40, 41, 42]).length == 4


def test_memory_counts_the_state(target):
    """A row's state is counted in its cache's bytes, in admission's and in a cached prefix's (docs/models.md)."""
    shape = target.recurrent
    assert shape.layers == 3 and target.num_kv_layers == 3
    assert target.state_bytes_per_row == shape.layers * (shape.channels * shape.conv_width * 4
                                                         + shape.heads * shape.key_dim * shape.value_dim * 4)
    cache = target.new_cache(2, 100)
    assert cache.nbytes == 2 * 100 * target.kv_bytes_per_token + 2 * target.state_bytes_per_row
    engine = Engine(target, tiny_tokenizer(128), verify_cost=None)
    engine.generate([5, 6, 7], max_new_tokens=4, speculate="none")
    assert engine.prefix_cache.nbytes >= target.state_bytes_per_row


def test_suffix_speculation_with_many_empty_steps_is_exact():
    """vLLM #39273's case: suffix decoding on a hybrid model, where most steps have no draft and others a rejected
    one, on repetitive prompts; batched calls of different lengths, on the MoE variant. (Accepted drafts: the
    noisy-oracle cases of tests/test_architectures.py.)"""
    model = tiny_causal_lm("qwen3_5_moe", seed=4)
    engine = Engine(TargetModel(model), tiny_tokenizer(128), router=lambda proposals, contexts: list(proposals))
    unit = [11, 12, 13, 14, 15, 16, 17]
    prompts = [unit * 6, [40, 41] + unit * 3, [7, 8, 9]]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=2,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        want.append(ref)
    got = engine.generate(prompts, max_new_tokens=40, speculate="suffix", num_speculative_tokens=8)
    assert [r.token_ids for r in got] == want
    stats = got[0].stats  # steps without a draft, and drafts rejected
    assert stats.by_source["suffix"].drafts < stats.steps and stats.draft_tokens > stats.accepted_tokens
