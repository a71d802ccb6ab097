"""The CPU attention kernel of decode and verification steps (`hybridspec/attention_kernel.h`): PyTorch's attention's
result under any tree mask, rows of any length and every head size it takes; each row's output bitwise the same
whatever else the step holds; and the target's steps equal with the kernel and without it."""
from __future__ import annotations

import random

import pytest
import torch

from hybridspec.model.inputs import StepInput
from hybridspec.model.target import TargetModel

attention = pytest.importorskip("hybridspec.model._attention")
if not attention.supported():
    pytest.skip("this CPU has no AVX-512F: the target uses PyTorch's attention", allow_module_level=True)


def run_kernel(q, keys, values, prefix, see, threads=1, sinks=None):
    """q [B, H, R, D]; keys/values [B, H, capacity, D]; prefix [B]; see [B, nq, nq] bool; sinks [H * R / nq]."""
    b, h, r, d = q.shape
    nq = see.shape[1]
    q, out = q.contiguous(), torch.empty_like(q)
    prefix = torch.as_tensor(prefix, dtype=torch.int64)
    see = see.to(torch.uint8).contiguous()
    scores = torch.empty(threads, r * (int(prefix.max()) + nq + 16))
    assert attention.decode_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(),
                                      scores.data_ptr(), scores.shape[1], b, h, r, d, nq, prefix.data_ptr(),
                                      see.data_ptr(), 0 if sinks is None else sinks.data_ptr(), keys.stride(0),
                                      keys.stride(1), keys.stride(2), d ** -0.5, threads)
    return out


def attention_with_sinks(q, k, v, mask, sinks):
    """q [H, R, D], k and v [H, n, D], mask [R, n] bool; sinks [H, R]: a logit in each row's softmax with no value
    (gpt-oss), as transformers computes it: the sink a column of the scores, dropped after the softmax."""
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(torch.cat([scores, sinks[..., None]], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def reference(q, keys, values, prefix, see, sinks=None):
    b, h, r, d = q.shape
    nq = see.shape[1]
    outs = []
    for row in range(b):
        n = int(prefix[row]) + nq
        mask = torch.ones(r, n, dtype=torch.bool)
        for i in range(r):
            mask[i, prefix[row]:] = see[row, i % nq]
        if sinks is None:
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[row], keys[row, :, :n], values[row, :, :n], attn_mask=mask))
        else:  # row i of KV head kv is query head kv * group + i // nq
            outs.append(attention_with_sinks(q[row], keys[row, :, :n], values[row, :, :n], mask,
                                             sinks.view(h, -1).repeat_interleave(nq, dim=1)))
    return torch.stack(outs)


@pytest.mark.parametrize("dim", [16, 32, 64, 128])
@pytest.mark.parametrize("nq", [1, 3, 8])
def test_the_kernel_is_attention_under_a_tree_mask(dim, nq):
    """Rows of different lengths (a batch), a random tree over the step's own keys (each query sees itself), several
    query heads folded onto each KV head, and lengths around the kernel's blocks of 16 keys."""
    gen = torch.Generator().manual_seed(dim * 10 + nq)
    batch, heads, group, capacity = 3, 2, 3, 90
    q = torch.randn(batch, heads, group * nq, dim, generator=gen)
    keys = torch.randn(batch, heads, capacity, dim, generator=gen)
    values = torch.randn(batch, heads, capacity, dim, generator=gen)
    prefix = [15, 32, 70][:batch]
    see = (torch.rand(batch, nq, nq, generator=gen) < 0.5).tril() | torch.eye(nq, dtype=torch.bool)
    torch.testing.assert_close(run_kernel(q, keys, values, prefix, see), reference(q, keys, values, prefix, see),
                               atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dim", [64, 128])
def test_the_kernel_takes_attention_sinks(dim):
    """gpt-oss's sinks (a logit per query head with no value in each softmax's denominator): rows of different
    lengths, a tree, three query heads per KV head, each with its own sink, some larger than every score."""
    gen = torch.Generator().manual_seed(dim)
    batch, heads, group, nq = 2, 2, 3, 4
    q = torch.randn(batch, heads, group * nq, dim, generator=gen)
    keys = torch.randn(batch, heads, 80, dim, generator=gen)
    values = torch.randn(batch, heads, 80, dim, generator=gen)
    prefix = [9, 60]
    see = (torch.rand(batch, nq, nq, generator=gen) < 0.5).tril() | torch.eye(nq, dtype=torch.bool)
    sinks = torch.tensor([-2.0, 0.5, 3.0, 8.0, -0.5, 1.5])
    expected = reference(q, keys, values, prefix, see, sinks)
    assert not torch.allclose(expected, reference(q, keys, values, prefix, see), atol=1e-3)  # the sinks matter
    torch.testing.assert_close(run_kernel(q, keys, values, prefix, see, sinks=sinks), expected, atol=2e-6,
                               rtol=2e-5)


def test_the_kernel_rejects_a_head_size_it_does_not_have():
    q = torch.randn(1, 1, 1, 48)
    keys = torch.randn(1, 1, 8, 48)
    assert not attention.decode_attention(q.data_ptr(), keys.data_ptr(), keys.data_ptr(), q.data_ptr(),
                                          torch.empty(64).data_ptr(), 64, 1, 1, 1, 48, 1,
                                          torch.tensor([4]).data_ptr(), torch.ones(1, 1, 1, dtype=torch.uint8)
                                          .data_ptr(), 0, keys.stride(0), keys.stride(1), keys.stride(2), 1.0, 1)


def test_a_rows_output_does_not_depend_on_the_rest_of_the_step():
    """A query's output is bitwise the same alone (a plain step) and in a verification pass of any size, where it
    sees the same keys: the sums run in an order fixed by the key's index, and keys it does not see add exact zeros.
    So speculation cannot change a token through attention's rounding."""
    gen = torch.Generator().manual_seed(0)
    dim, heads, group, prefix = 64, 3, 3, 203
    keys = torch.randn(1, heads, 300, dim, generator=gen)
    values = torch.randn(1, heads, 300, dim, generator=gen)
    alone_q = torch.randn(1, heads, group, dim, generator=gen)
    alone = run_kernel(alone_q, keys, values, [prefix], torch.ones(1, 1, 1, dtype=torch.bool))
    for nq in (2, 5, 17):
        # query 0 of the pass is the plain step's query; the others are draft tokens after it
        q = torch.randn(1, heads, group * nq, dim, generator=gen)
        q[:, :, ::nq] = alone_q
        see = torch.ones(nq, nq, dtype=torch.bool).tril()[None]
        out = run_kernel(q, keys, values, [prefix], see)
        assert torch.equal(out[:, :, ::nq], alone)


def test_the_output_does_not_depend_on_the_threads():
    """A step's (row, KV head) pairs are dealt among threads, each pair computed by one thread: bitwise the same
    output on one, two or three threads (more threads than pairs included), each with its own scratch."""
    gen = torch.Generator().manual_seed(1)
    dim, nq = 128, 3
    q = torch.randn(3, 2, 2 * nq, dim, generator=gen)
    keys = torch.randn(3, 2, 700, dim, generator=gen)
    values = torch.randn(3, 2, 700, dim, generator=gen)
    see = torch.ones(3, nq, nq, dtype=torch.bool).tril()
    prefix = [650, 300, 697]
    one = run_kernel(q, keys, values, prefix, see, threads=1)
    torch.testing.assert_close(one, reference(q, keys, values, prefix, see), atol=2e-6, rtol=2e-5)
    for threads in (2, 3, 8):
        assert torch.equal(run_kernel(q, keys, values, prefix, see, threads=threads), one)


def test_target_steps_are_the_same_with_the_kernel_and_without(tiny_model):
    """The target's verification passes (chains, trees, rows of different lengths, a prompt chunk before a tree)
    give PyTorch attention's logits with the kernel."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (20, 33, 9)]
    with_kernel, without = TargetModel(tiny_model), TargetModel(tiny_model)
    assert with_kernel.attention.kernel
    without.attention.kernel = False
    outputs = []
    for model in (with_kernel, without):
        batch, one = model.new_cache(2, 128), model.new_cache(1, 128)
        model.prefill(batch, prompts[:2])
        model.prefill(one, prompts[2:])
        tree = model.step(batch, [5, 6], [[7, 8, 9], [10]], [[-1, 0, 0], None]).logits
        chunk_then_tree = model.step_many([StepInput(one, [4], [[11, 12, 13]], [[-1, 0, 1]],
                                                     prompt=list(range(20, 40)))])[0].logits
        outputs.append((tree, chunk_then_tree))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_the_steps_of_many_caches_attend_in_one_call_as_they_would_apart(tiny_model, monkeypatch):
    """A pass of concurrent calls' steps (one-row caches of different lengths, a two-row cache, chains and a tree of
    the same size, beside a prompt chunk and a step of another size): the steps of one size attend in one kernel call
    per layer, and the pass's logits and the keys and values it writes are bitwise those of one call per cache."""
    from hybridspec.model.attention import Attention

    rng = random.Random(5)
    seq = lambda n: [rng.randrange(3, 128) for _ in range(n)]  # noqa: E731
    model = TargetModel(tiny_model)
    lengths = (7, 30, 18, 64)
    real = Attention.join_steps

    def run(join: bool):
        rng.seed(5)
        caches = [model.new_cache(1, 16) for _ in lengths] + [model.new_cache(2, 16), model.new_cache(1, 16),
                                                              model.new_cache(1, 16)]
        for cache, n in zip(caches, lengths + (20, 9, 12)):
            model.prefill(cache, [seq(n)] * cache.batch_size)
        inputs = [StepInput(c, [5], [seq(3)], [None]) for c in caches[:3]]
        inputs += [StepInput(caches[3], [6], [seq(3)], [[-1, 0, 0]]), StepInput(caches[4], [7, 8], [seq(3), seq(3)]),
                   StepInput(caches[5], [], prompt=seq(21)), StepInput(caches[6], [9], [seq(1)])]
        joined = []
        if join:
            monkeypatch.setattr(Attention, "join_steps",
                                lambda self, *a: joined.extend(real(self, *a)) or joined, raising=True)
        else:
            monkeypatch.setattr(Attention, "join_steps", lambda self, *a: [])
        outs = model.step_many(inputs)
        return outs, caches, joined

    apart, apart_caches, _ = run(join=False)
    together, caches, joined = run(join=True)
    assert [j.parts for j in joined] == [[0, 1, 2, 3, 4]]  # the five steps of 4 inputs; not the chunk, not the other
    for a, b in zip(apart, together):
        assert torch.equal(a.logits, b.logits)
    for a, b in zip(apart_caches, caches):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_bench_attention_writes_its_table(tmp_path, capsys):
    import json

    import bench_attention

    path = tmp_path / "attention.json"
    assert bench_attention.main(["--contexts", "40,70", "--queries", "1,3", "--layers", "2", "--repeats", "1",
                                 "--bandwidth", "10", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["context"], r["queries"]) for r in rows] == [(40, 1), (40, 3), (70, 1), (70, 3)]
    for r in rows:
        assert r["speedup"] == pytest.approx(r["flash_ms"] / r["kernel_ms"], rel=0.1)
        assert r["bound_ms"] == pytest.approx(2 * 2 * 3 * (r["context"] + r["queries"]) * 64 * 4 / 10e6, abs=1e-3)
    assert "kernel ms" in capsys.readouterr().out


def run_prompt_kernel(q, keys, values, start, workers=1, sinks=None, window=0):
    """q [B, H * group, nq, D] at positions start.. (its keys already in the cache); keys/values [B, H, capacity, D];
    sinks [H * group]."""
    from hybridspec.model import attention as module

    with_threads = torch.get_num_threads()
    torch.set_num_threads(workers)
    try:
        return module._prompt_kernel(q, keys, values, start, keys.shape[1], sinks, window)
    finally:
        torch.set_num_threads(with_threads)


def prompt_reference(q, keys, values, start, sinks=None, window=0):
    b, heads, nq, d = q.shape
    kv_heads = keys.shape[1]
    n = start + nq
    mask = torch.ones(nq, n, dtype=torch.bool).tril(start)  # query i sees keys [0, start + i]
    if window:  # and none before start + i - window + 1
        mask &= ~torch.ones(nq, n, dtype=torch.bool).tril(start - window)
    k = keys[:, :, :n].repeat_interleave(heads // kv_heads, dim=1)
    v = values[:, :, :n].repeat_interleave(heads // kv_heads, dim=1)
    if sinks is not None:
        return torch.stack([attention_with_sinks(q[i], k[i], v[i], mask, sinks[:, None].expand(heads, nq))
                            for i in range(b)])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dim", [16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
def test_the_prompt_kernel_is_causal_attention_after_the_cache(dim, group):
    """A prompt chunk of nq queries after `start` cached tokens, each query seeing the cache and the chunk up to
    itself: chunks around the kernel's tiles of 16 queries and blocks of 128 keys, a batch, every head size, and
    1 to 7 query heads per KV head (its micro-tiles take 3 heads at a time)."""
    gen = torch.Generator().manual_seed(dim * 10 + group)
    kv_heads = 2
    for start, nq in ((0, 1), (0, 16), (5, 17), (0, 130), (120, 9), (255, 40), (300, 200)):
        keys = torch.randn(2, kv_heads, start + nq + 7, dim, generator=gen)
        values = torch.randn(2, kv_heads, start + nq + 7, dim, generator=gen)
        q = torch.randn(2, kv_heads * group, nq, dim, generator=gen)
        torch.testing.assert_close(run_prompt_kernel(q, keys, values, start), prompt_reference(q, keys, values, start),
                                   atol=3e-6, rtol=3e-5, msg=f"start {start}, {nq} queries")


@pytest.mark.parametrize("dim", [64, 128])
def test_the_prompt_kernel_takes_attention_sinks(dim):
    """Sinks in the prompt kernel's running softmax (its sums start from the sink): chunks after a cache and from
    the start, heads 3 to a KV head (two micro-tiles of heads) with sinks below and above the scores."""
    gen = torch.Generator().manual_seed(dim + 1)
    kv_heads, group = 2, 4
    sinks = torch.tensor([-3.0, 0.0, 2.0, 6.0, 1.0, -1.0, 4.0, 0.5])
    for start, nq in ((0, 1), (0, 40), (130, 17), (300, 200)):
        keys = torch.randn(1, kv_heads, start + nq, dim, generator=gen)
        values = torch.randn(1, kv_heads, start + nq, dim, generator=gen)
        q = torch.randn(1, kv_heads * group, nq, dim, generator=gen)
        expected = prompt_reference(q, keys, values, start, sinks)
        assert not torch.allclose(expected, prompt_reference(q, keys, values, start), atol=1e-3)
        torch.testing.assert_close(run_prompt_kernel(q, keys, values, start, sinks=sinks), expected, atol=3e-6,
                                   rtol=3e-5, msg=f"start {start}, {nq} queries")


@pytest.mark.parametrize("window", [16, 20, 128, 200])
def test_the_prompt_kernel_attends_within_a_sliding_window(window):
    """A sliding-window layer's prompt chunk: each query sees its last `window` positions only (gpt-oss: 128, with
    sinks), chunks from the start and after a cache shorter and longer than the window, tiles that begin inside it."""
    gen = torch.Generator().manual_seed(window)
    kv_heads, group, dim = 2, 3, 64
    sinks = torch.linspace(-2.0, 4.0, kv_heads * group)
    for start, nq, with_sinks in ((0, 1, False), (0, 40, True), (5, 300, False), (window - 1, 17, True),
                                  (300, 200, True)):
        keys = torch.randn(1, kv_heads, start + nq, dim, generator=gen)
        values = torch.randn(1, kv_heads, start + nq, dim, generator=gen)
        q = torch.randn(1, kv_heads * group, nq, dim, generator=gen)
        s = sinks if with_sinks else None
        expected = prompt_reference(q, keys, values, start, s, window)
        if start + nq > window + 1:
            assert not torch.allclose(expected, prompt_reference(q, keys, values, start, s), atol=1e-3)
        torch.testing.assert_close(run_prompt_kernel(q, keys, values, start, sinks=s, window=window), expected,
                                   atol=3e-6, rtol=3e-5, msg=f"start {start}, {nq} queries")


def test_the_prompt_kernel_gives_the_same_bits_on_any_number_of_threads():
    """Each tile of 16 queries is computed alone, whichever thread runs it: a prompt's cache does not depend on the
    machine's thread count."""
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 3, 700, 64, generator=gen), torch.randn(1, 3, 700, 64, generator=gen)
    q = torch.randn(1, 9, 300, 64, generator=gen)
    one = run_prompt_kernel(q, keys, values, 390, workers=1)
    for workers in (2, 3):
        assert torch.equal(run_prompt_kernel(q, keys, values, 390, workers=workers), one)
