"""TargetModel against transformers' own forward pass without a cache (the independent reference): prefill, chain and
tree verification, KV crop and compaction after acceptance, batches with per-row lengths, hidden-state capture."""
from __future__ import annotations

import random
import time

import pytest
import torch

from bench_verify_cost import measure_calls_step, measure_prefill
from hybridspec.model.calibration import measure_verify_cost
from hybridspec.model.kv_cache import KVCache, tree_depths_and_mask
from hybridspec.model.linear import AMX, KERNEL_ROWS
from hybridspec.speculators import default_aux_layer_ids
from hybridspec.model.inputs import StepInput
from hybridspec.model.target import TargetModel

ATOL = 2e-4


@pytest.fixture(scope="module")
def target(tiny_model):
    return TargetModel(tiny_model)


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: transformers' forward over the whole sequence, no cache."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(n)]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_mask_is_ancestor_or_self():
    parents = [-1, -1, 0, 2, 1, 0]
    depth, mask = tree_depths_and_mask(parents)
    assert depth == [0, 1, 1, 2, 3, 2, 2]
    for i in range(len(parents)):
        ancestors = {0} | {a + 1 for a in path_to(parents, i)}
        assert {j for j in range(len(parents) + 1) if mask[i + 1, j]} == ancestors


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2]])
def test_tree_mask_rejects_parents_after_children(parents):
    with pytest.raises(ValueError, match="parent must precede"):
        tree_depths_and_mask(parents)


def test_prefill_in_chunks_with_cache_growth_matches_reference(target, tiny_model):
    tokens = [random.Random(1).randrange(128) for _ in range(70)]
    cache = target.new_cache(1, capacity=8)  # forces several regrowths
    out = target.prefill(cache, [tokens], chunk_size=16)
    assert cache.lengths == [70] and cache.capacity >= 70
    torch.testing.assert_close(out.logits[0, -1], reference_logits(tiny_model, tokens)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_chain_verify_and_crop_match_reference(target, tiny_model, seed):
    rng = random.Random(seed)
    seq = [rng.randrange(128) for _ in range(rng.randint(2, 30))]
    cache = target.new_cache(1, capacity=16)
    target.prefill(cache, [seq[:-1]])
    for _ in range(4):
        draft = [rng.randrange(128) for _ in range(rng.randint(0, 6))]
        out = target.step(cache, [seq[-1]], [draft])
        ref = reference_logits(tiny_model, seq + draft)
        torch.testing.assert_close(out.logits[0], ref[len(seq) - 1:], atol=ATOL, rtol=0)
        accepted = rng.randint(0, len(draft))  # keep a prefix: the rest is cropped
        cache.commit(0, list(range(accepted + 1)))
        seq = seq + draft[:accepted] + [rng.randrange(128)]
        assert cache.lengths == [len(seq) - 1]
    # after all the crops the cache still equals a fresh recompute
    out = target.step(cache, [seq[-1]])
    torch.testing.assert_close(out.logits[0, 0], reference_logits(tiny_model, seq)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_tree_verify_and_compaction_match_reference(target, tiny_model, seed):
    rng = random.Random(100 + seed)
    seq = [rng.randrange(128) for _ in range(rng.randint(2, 20))]
    cache = target.new_cache(1, capacity=16)
    target.prefill(cache, [seq[:-1]])
    for _ in range(3):
        n = rng.randint(1, 10)
        parents, draft = random_tree(rng, n), [rng.randrange(128) for _ in range(n)]
        out = target.step(cache, [seq[-1]], [draft], [parents])
        for node in range(n):  # every node sees exactly the sequence + its root-to-node path
            path = [draft[i] for i in path_to(parents, node)]
            expected = reference_logits(tiny_model, seq + path)[-1]
            torch.testing.assert_close(out.logits[0, 1 + node], expected, atol=ATOL, rtol=0)
        accepted = path_to(parents, rng.randrange(n))  # accept a root-to-node path: its KV is compacted
        cache.commit(0, [0] + [1 + i for i in accepted])
        seq = seq + [draft[i] for i in accepted] + [rng.randrange(128)]
    out = target.step(cache, [seq[-1]], [[5, 6]])
    torch.testing.assert_close(out.logits[0], reference_logits(tiny_model, seq + [5, 6])[len(seq) - 1:],
                               atol=ATOL, rtol=0)


def test_batched_prefill_where_a_row_ends_beyond_a_later_chunks_width(target, tiny_model):
    """Rows of 40 and 25 tokens in chunks of 16: the short row ends at position 8 of the second chunk, past the width
    (8) of the last chunk, where it has no tokens; each row's logits are still its last token's."""
    rng = random.Random(3)
    seqs = [[rng.randrange(128) for _ in range(n)] for n in (40, 25)]
    cache = target.new_cache(2, capacity=48)
    out = target.prefill(cache, seqs, chunk_size=16)
    assert cache.lengths == [40, 25]
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(out.logits[row, 0], reference_logits(tiny_model, seq)[-1], atol=ATOL, rtol=0)


def test_batch_rows_with_own_lengths_drafts_and_trees(target, tiny_model):
    rng = random.Random(7)
    seqs = [[rng.randrange(128) for _ in range(n)] for n in (3, 17, 9)]
    cache = target.new_cache(3, capacity=8)
    out = target.prefill(cache, [seq[:-1] for seq in seqs], chunk_size=8)  # rows end in different chunks
    assert cache.lengths == [len(seq) - 1 for seq in seqs]
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(out.logits[row, 0], reference_logits(tiny_model, seq[:-1])[-1], atol=ATOL, rtol=0)
    for _ in range(3):
        drafts = [[rng.randrange(128) for _ in range(rng.randint(0, 5))] for _ in seqs]
        parents = [random_tree(rng, len(d)) if row == 1 else None for row, d in enumerate(drafts)]
        out = target.step(cache, [s[-1] for s in seqs], drafts, parents)
        for row, (seq, draft) in enumerate(zip(seqs, drafts)):
            tree = parents[row] or list(range(-1, len(draft) - 1))
            for node in range(-1, len(draft)):
                path = [draft[i] for i in path_to(tree, node)] if node >= 0 else []
                torch.testing.assert_close(out.logits[row, 1 + node], reference_logits(tiny_model, seq + path)[-1],
                                           atol=ATOL, rtol=0)
            keep = path_to(tree, len(draft) - 1) if draft else []
            cache.commit(row, [0] + [1 + i for i in keep])
            seqs[row] = seq + [draft[i] for i in keep] + [rng.randrange(128)]
    cache.select_rows([2, 0])  # a sequence finished: its row leaves, the others keep their KV
    out = target.step(cache, [seqs[2][-1], seqs[0][-1]])
    for row, seq in enumerate([seqs[2], seqs[0]]):
        torch.testing.assert_close(out.logits[row, 0], reference_logits(tiny_model, seq)[-1], atol=ATOL, rtol=0)


def test_hidden_states_are_layer_inputs_and_final_norm(target, tiny_model):
    tokens = list(range(10, 30))
    cache = target.new_cache(1)
    target.prefill(cache, [tokens[:12]])
    out = target.step(cache, [tokens[12]], [tokens[13:]], return_hidden=True)
    with torch.no_grad():
        ref = tiny_model(torch.tensor([tokens]), output_hidden_states=True)
    layers = default_aux_layer_ids(tiny_model.config.num_hidden_layers)
    assert layers == (2, 3, 3)
    # hidden_states[i] is the input of layer i; the last entry is the final, normed state
    expected_aux = torch.cat([ref.hidden_states[i][0, 12:] for i in layers], dim=-1)
    torch.testing.assert_close(out.aux_hidden[0], expected_aux, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.final_hidden[0], ref.hidden_states[-1][0, 12:], atol=ATOL, rtol=0)
    assert target.step(cache, [1]).aux_hidden is None  # not computed unless asked for


def test_prefill_returns_the_drafter_features_of_each_row(target, tiny_model):
    """drafter_context=n: per row, the hidden states of its last n new tokens, across chunk boundaries and for rows of
    different lengths (one row getting no tokens at all), equal to transformers' at those positions."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (37, 9, 0)]
    cache = target.new_cache(3)
    out = target.prefill(cache, prompts, chunk_size=8, drafter_context=12)
    layers = default_aux_layer_ids(tiny_model.config.num_hidden_layers)
    for (aux, final), tokens in zip(out.drafter_features, prompts):
        assert aux.shape[0] == final.shape[0] == min(12, len(tokens))
        if not tokens:
            continue
        with torch.no_grad():
            ref = tiny_model(torch.tensor([tokens]), output_hidden_states=True)
        tail = slice(len(tokens) - aux.shape[0], len(tokens))
        # hidden states run to ~20 here: float32 rounding relative to them as well
        torch.testing.assert_close(aux, torch.cat([ref.hidden_states[i][0, tail] for i in layers], -1), atol=ATOL,
                                   rtol=1e-5)
        torch.testing.assert_close(final, ref.hidden_states[-1][0, tail], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[0, -1], reference_logits(tiny_model, prompts[0])[-1], atol=ATOL, rtol=0)


def test_bad_input_raises(target):
    cache = target.new_cache(1)
    with pytest.raises(ValueError, match="at least one token"):
        target.prefill(cache, [[]])
    with pytest.raises(ValueError, match="exceed the model's context"):
        target.prefill(cache, [[1] * (target.max_seq_len + 1)])
    with pytest.raises(ValueError, match="token ids must lie"):
        target.prefill(cache, [[1, 128]])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\)"):
        target.step(cache, [1], [[128]])
    with pytest.raises(ValueError, match="2 draft tokens but 1 parents"):
        target.step(cache, [1], [[3, 4]], [[-1]])
    with pytest.raises(ValueError, match="got 2 rows for a cache of 1"):
        target.step(cache, [1, 2])
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(0, 5)


def test_unsupported_architecture_is_refused(tiny_model):
    class Config:
        model_type = "gpt2"

    class Model:
        config = Config()

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        TargetModel(Model())


def test_measure_verify_cost_reports_every_size(target):
    cost = measure_verify_cost(target, (0, 2, 5), context=16, repeats=1)
    assert cost["draft_tokens"] == [0, 2, 5] and len(cost["ms"]) == 3
    assert cost["relative"][0] == 1.0 and all(t > 0 for t in cost["ms"])


def test_machine_verify_cost_is_measured_once_per_machine_and_model(target, tmp_path, monkeypatch):
    """Engine(verify_cost="auto"): the table is measured on first use (contexts that fit the model only), kept in the
    user cache, read back by later engines on the same model, and what the gate plans with."""
    from hybridspec.model import calibration
    from hybridspec.router import CostGate

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    measured = []

    def quick(target, *, context, repeats, prefill):
        measured.append(context)
        assert not prefill  # the cache is filled, not prefilled
        return measure_verify_cost(target, (0, 1, 4), context=context, repeats=1, prefill=False)

    monkeypatch.setattr(calibration, "measure_verify_cost", quick)
    measure_pass = calibration.measure_pass_cost
    monkeypatch.setattr(calibration, "measure_pass_cost",
                        lambda target, repeats: measure_pass(target, tokens=(1, 4, 16), rows=(1, 4), repeats=1))
    tables = calibration.machine_verify_cost(target, contexts=(64, 128, 4096), progress=False)
    assert measured == [64, 128]  # 4096 is past the tiny model's 512 positions
    assert [t["context"] for t in tables["by_context"]] == [64, 128]
    assert calibration.machine_verify_cost(target, contexts=(64, 128), progress=False) == tables
    assert measured == [64, 128]  # read back, not measured again
    gate = CostGate(tables)
    first = tables["by_context"][0]
    ratios = [t / first["ms"][0] for t in first["ms"]]  # k = 0, 1, 4
    assert gate.cost(4, 64) == pytest.approx(max(1.0, ratios[1], ratios[2]), rel=1e-6)  # made non-decreasing
    passes = tables["pass"]  # a batched pass by tokens and rows, which the gate plans steps of several rows with
    assert passes["tokens"] == [1, 4, 16] and len(passes["tokens_ms"]) == 3 and passes["per_row_ms"] >= 0
    assert gate.pass_cost.tokens(16) == pytest.approx(max(passes["tokens_ms"]))
    calibration.machine_verify_cost(target, contexts=(64, 128), remeasure=True, progress=False)
    assert measured == [64, 128, 64, 128]


def test_a_calibration_beside_other_work_measures_the_passes_not_the_waits(target, monkeypatch):
    """On one torch thread the tables are timed by the thread's CPU time (`work_clock`), the fastest repeat: a pass
    that waits for the core (here: sleeps, as when another process holds it) costs what it computed. Version 2's
    wall-clock medians made a pass of 2 tokens cost 4x one on a machine busy with training."""
    from hybridspec.model import calibration
    from hybridspec.model.machine import work_clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert work_clock() is time.perf_counter  # threads' CPU time would count their spinning
        torch.set_num_threads(1)
        assert work_clock() is time.thread_time
        step, calls = target.step, []

        def descheduled(cache, tokens, drafts, **kw):
            calls.append(1)
            if len(calls) % 2 == 0:  # every k = 4 pass loses the core for 0.3 s
                time.sleep(0.3)
            return step(cache, tokens, drafts, **kw)

        monkeypatch.setattr(target, "step", descheduled)
        busy = measure_verify_cost(target, (0, 4), context=16, repeats=2, prefill=False)
        assert busy["clock"] == "thread_time" and busy["ms"][1] < 100  # the 300 ms waits are not in it
        monkeypatch.setattr(calibration, "work_clock", lambda: time.perf_counter)  # what version 2 timed by
        assert measure_verify_cost(target, (0, 4), context=16, repeats=2, prefill=False)["ms"][1] > 300
    finally:
        torch.set_num_threads(threads)


def test_measure_verify_cost_without_prefill_fills_the_cache(target):
    cost = measure_verify_cost(target, (0, 3), context=100, repeats=1, prefill=False)
    assert cost["context"] == 100 and len(cost["ms"]) == 2 and all(t > 0 for t in cost["ms"])


def test_measure_prefill_times_the_new_tokens_after_the_cached_ones(target):
    result = measure_prefill(target, cached=20, new=12, repeats=1)
    assert (result["cached"], result["new"]) == (20, 12) and result["s"] > 0
    assert result["ms_per_token"] == pytest.approx(1000 * result["s"] / 12, abs=0.01)  # both rounded


def test_measure_calls_step_times_joined_and_apart_and_puts_the_join_back(target, monkeypatch):
    from hybridspec.model.attention import Attention

    joining, seen = Attention.join_steps, []
    monkeypatch.setattr(Attention, "join_steps", lambda self, *a: seen.append(1) or joining(self, *a))
    patched = Attention.join_steps
    result = measure_calls_step(target, calls=3, context=20, repeats=1)
    assert (result["calls"], result["context"]) == (3, 20) and result["joined_ms"] > 0 and result["apart_ms"] > 0
    assert seen and Attention.join_steps is patched  # the joined way ran, and the class is as it was


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_linear_products_in_a_compute_dtype(rows):
    """Linear(compute_dtype=bfloat16) multiplies in bfloat16 and returns the input's dtype; the packed float32 product
    equals F.linear's."""
    from hybridspec.model.linear import Linear

    torch.manual_seed(rows)
    for out_features in (48, 8192):
        w, b, x = torch.randn(out_features, 64), torch.randn(out_features), torch.randn(rows, 64)
        y = Linear(w, b, compute_dtype=torch.bfloat16)(x)
        want = torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        torch.testing.assert_close(y, want, atol=0.1, rtol=2e-2)
        assert not torch.allclose(y, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=0)  # really bfloat16
        torch.testing.assert_close(Linear(w, b)(x), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)

    # plus: the residual added inside the product is the sum of the two
    w, x, residual = torch.randn(48, 64), torch.randn(1, rows, 64), torch.randn(1, rows, 48)
    torch.testing.assert_close(Linear(w).plus(x, residual), residual + x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not KERNEL_ROWS, reason="the small-row product kernel needs an AVX-512 CPU")
@pytest.mark.parametrize("shape", [(96, 64), (1003, 1000), (5, 17)])
def test_small_row_products_are_right_and_each_row_alone(shape, monkeypatch):
    """A float32 product of 1 to 8 rows runs the kernel: F.linear's result (with a bias, with `plus`'s residual, from a
    strided input, for sizes that are no multiple of its blocks), and each output row bitwise the same as that row's
    product alone, whatever the row count: a token's logits do not depend on the draft it is verified with. Past
    eight rows, oneDNN's product."""
    from hybridspec.model import linear
    from hybridspec.model.linear import Linear

    F = torch.nn.functional
    torch.manual_seed(shape[0])
    w, b = torch.randn(shape), torch.randn(shape[0])
    lin, plain = Linear(w, b), Linear(w)
    assert lin.kernel_rows == KERNEL_ROWS == 8
    x = torch.randn(KERNEL_ROWS + 1, 2 * shape[1])[:, ::2]  # every other column: not contiguous
    residual = torch.randn(KERNEL_ROWS + 1, shape[0])
    alone = torch.cat([lin(x[i:i + 1]) for i in range(KERNEL_ROWS)])
    for rows in range(1, KERNEL_ROWS + 1):
        y = lin(x[:rows])
        torch.testing.assert_close(y, F.linear(x[:rows], w, b), atol=1e-4, rtol=1e-4)
        assert torch.equal(y, alone[:rows])
        torch.testing.assert_close(plain.plus(x[:rows], residual[:rows]), residual[:rows] + x[:rows] @ w.T,
                                   atol=1e-4, rtol=1e-4)
    calls, real = [], linear._products.small_product
    monkeypatch.setattr(linear._products, "small_product", lambda *a: calls.append(a[-3]) or real(*a))
    lin(x[:3].reshape(1, 3, -1)), lin(x)
    assert calls == [3]  # nine rows ran oneDNN's product
    assert Linear(w, compute_dtype=torch.bfloat16).kernel_rows == 0  # float32 only


@pytest.mark.skipif(not KERNEL_ROWS, reason="the small-row product kernel needs an AVX-512 CPU")
@pytest.mark.parametrize("shape", [(96, 64), (1003, 1000), (5, 17)])
def test_a_weight_of_bfloat16_or_float16_values_streams_compact_with_the_same_bits(shape):
    """A packed float32 weight whose values are all bfloat16 (a bfloat16 checkpoint loaded into float32) or all float16
    ones is kept in that format for the kernel (half the bytes) and its products, with a bias and with `plus`'s
    residual, for sizes no multiple of a vector, are bitwise those of the float32 weight; any other weight stays
    float32."""
    from hybridspec.model import linear
    from hybridspec.model.linear import Linear

    torch.manual_seed(shape[1])
    w, b = torch.randn(shape), torch.randn(shape[0])
    x = torch.randn(KERNEL_ROWS, 2 * shape[1])[:, ::2]
    residual = torch.randn(KERNEL_ROWS, shape[0])
    as_f16 = w.half().float()
    assert not torch.equal(as_f16.bfloat16().float(), as_f16)  # float16 values that bfloat16 does not hold
    for values, dtype, name in ((w.bfloat16().float(), torch.bfloat16, linear._products.WEIGHT_BF16),
                                (as_f16, torch.float16, linear._products.WEIGHT_F16), (w, torch.float32, 0)):
        compact, full = Linear(values, b), Linear(values, b, pack=False)  # unpacked: the plain weight stays float32
        assert (compact.weight.dtype, compact.format) == (dtype, name) and full.format == 0
        assert compact.weight.data_ptr() != values.data_ptr() or dtype == torch.float32
        for rows in range(1, KERNEL_ROWS + 1):
            assert torch.equal(compact(x[:rows]), full(x[:rows])), (dtype, rows)
            assert torch.equal(compact.plus(x[:rows], residual[:rows]), full.plus(x[:rows], residual[:rows]))
        torch.testing.assert_close(compact(x), torch.nn.functional.linear(x, values, b), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not AMX, reason="AMX tiles: an Intel Xeon of the 4th generation or later")
@pytest.mark.parametrize("shape", [(96, 64), (3072, 1024), (64, 2048)])
def test_a_prompt_chunk_of_bfloat16_values_runs_on_amx_tiles_at_float32s_accuracy(shape):
    """A weight of bfloat16 values (shapes of 32s) multiplies more rows than the kernel's on AMX tiles, in place of
    oneDNN's float32 copy: each output within a few float32 roundings of the float64 product (relative to the sum of
    the products' magnitudes: the input split into three bfloat16 pieces loses nothing), with a bias and `plus`'s
    residual, every row bitwise the same whatever the row count; other shapes keep oneDNN's product."""
    from hybridspec.model.linear import Linear

    torch.manual_seed(shape[0])
    w, b = torch.randn(shape).bfloat16().float(), torch.randn(shape[0])
    lin = Linear(w, b)
    assert lin.amx is not None and lin.packed is None
    assert Linear(torch.randn(48, 40).bfloat16().float()).amx is None  # 40 is no multiple of 32
    x, residual = torch.randn(100, shape[1]), torch.randn(100, shape[0])
    exact = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    for rows in (9, 33, 100):
        y = lin(x[:rows])
        assert ((y.double() - exact[:rows]).abs() / scale[:rows]).max() < 4 * 2.0 ** -24
        assert torch.equal(y, lin(x[:100])[:rows])
        plus = lin.plus(x[:rows], residual[:rows])
        assert torch.equal(plus, y + residual[:rows])  # the sum, then the residual, as the kernel adds them


@pytest.mark.skipif(not KERNEL_ROWS, reason="the small-row product kernel needs an AVX-512 CPU")
def test_a_verified_draft_has_bitwise_the_logits_of_plain_steps(target):
    """With the small-row products and the step attention kernel, every input of a pass is computed alone: the logits
    at a chain's tokens are bitwise those of decoding the same tokens one plain step at a time, so greedy speculation
    picks exactly plain decoding's tokens even in a near-tie."""
    tokens = [5, 17, 33, 9, 60, 61, 62, 100]
    cache = target.new_cache(1, 64)
    target.prefill(cache, [tokens[:4]])
    chain = target.step(cache, [tokens[4]], [tokens[5:]]).logits[0]
    plain = []
    for token in tokens[4:]:
        plain.append(target.step(cache, [token]).logits[0, 0])
        cache.commit(0, [0])
    assert torch.equal(chain, torch.stack(plain))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_follows_its_routes(bias, monkeypatch):
    """A packed float32 Linear multiplies n rows as routes[n] says: MKL's product (F.linear on its plain weight) or
    oneDNN's packed one, on n rows or on n padded with zero rows; every route (and `plus`) gives F.linear's result.
    Row counts past the routes run oneDNN's product as they are."""
    from hybridspec.model import linear
    from hybridspec.model.linear import PLANNED_ROWS, Linear

    F = torch.nn.functional
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96) if bias else None
    lin = Linear(w, b)
    if lin.packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    lin.kernel_rows = 0  # as on a CPU without the small-row kernel (its own test below)
    calls, onednn = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(linear, "F", type("Spy", (), {"linear": lambda *a: calls.append(("mkl", a[0].shape[0]))
                                                      or F.linear(*a), "pad": F.pad}))
    routes = [(True, 0)] + [(n % 2 == 1 and n <= 3, n + (n % 3)) for n in range(1, PLANNED_ROWS + 1)]
    lin.routes = tuple(routes)
    for rows in range(1, PLANNED_ROWS + 3):
        calls.clear()
        x, residual = torch.randn(1, rows, 64), torch.randn(1, rows, 96)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lin.plus(x, residual), residual + F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        plain, padded = routes[rows] if rows <= PLANNED_ROWS else (False, rows)
        assert calls == ([("mkl", padded)] if plain else [])
        if not plain:  # the packed product saw the padded rows
            seen = []
            monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                                type("Spy", (), {"__call__": staticmethod(lambda x, *a: seen.append(x.shape[0])
                                                                          or onednn(x, *a))})())
            lin(x)
            monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", onednn)
            assert seen == [padded]
    bf16 = Linear(w, b, compute_dtype=torch.bfloat16)
    if linear._onednn_packs_bf16():
        assert bf16.weight is None  # a bfloat16 weight is kept packed only
        assert bf16._route(1) == (False, 1)  # no MKL route without the plain weight
    else:  # oneDNN packs bfloat16 only with AVX-512: F.linear multiplies it
        assert bf16.packed is None and bf16._route(1) == (True, 1)
    torch.testing.assert_close(bf16(x), F.linear(x, w, b), atol=0.5, rtol=0.05)


def test_plan_routes_takes_the_fastest_route_and_pads_only_for_a_clear_gain():
    from hybridspec.model.linear import PAD_MARGIN, PLANNED_ROWS, plan_routes

    times = {(False, m): 1.0 for m in range(1, PLANNED_ROWS + 1)}
    times[False, 4] = 0.8                      # four rows run faster than one to three
    times[True, 1] = 0.7                       # MKL's one-row product is the fastest of all
    times[False, 6] = 1.0 / PAD_MARGIN + 1e-3  # faster than five rows, but within the margin
    plan = plan_routes(times)
    assert plan[1] == (True, 1)
    assert plan[2] == plan[3] == (False, 4)
    assert plan[4] == (False, 4)
    assert plan[5] == (False, 5)  # padding to six would gain less than PAD_MARGIN
    assert all(plan[n] == (False, n) for n in range(6, PLANNED_ROWS + 1))


def test_tune_products_measures_once_per_machine_and_keeps_the_plan(tmp_path, monkeypatch):
    """The first tuning measures and stores the routes in the user cache; a second (another model with the same
    products, a later process) reads them back; remeasure=True measures again. Products the small-row kernel runs
    are not measured."""
    from hybridspec.model import linear
    from hybridspec.model.linear import Linear, tune_products

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    measured = []
    real = linear.time_routes

    def counting(linears, repeats):
        measured.append(len(linears))
        return real(linears, repeats=1)

    monkeypatch.setattr(linear, "time_routes", counting)
    torch.manual_seed(0)
    layers = [Linear(torch.randn(32, 16)) for _ in range(3)] + [Linear(torch.randn(16, 32))]
    if layers[0].packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    kernel = layers[0].kernel_rows
    assert tune_products(layers) == {} or not kernel  # the small-row kernel's products need no plan
    for lin in layers:
        lin.kernel_rows = 0  # as on a CPU without the kernel
    plans = tune_products(layers)
    assert measured == [4] and set(plans) == {layers[0].family, layers[3].family}
    assert all(lin.routes == tuple(map(tuple, plans[lin.family])) for lin in layers)
    assert list(tmp_path.glob("product_plans_*.json"))
    again = [Linear(torch.randn(32, 16))]
    again[0].kernel_rows = 0
    tune_products(again)
    assert measured == [4] and again[0].routes == layers[0].routes
    tune_products(again, remeasure=True)
    assert measured == [4, 1]
    x = torch.randn(2, 16)  # whatever the routes, the products are right
    torch.testing.assert_close(again[0](x), x @ again[0].weight.T, atol=1e-4, rtol=1e-4)


def test_greedy_head_finds_the_float32_argmax_in_near_ties():
    """GreedyHead's argmax is the exact one wherever the top two logits differ by more than float32 noise, also where
    they differ by far less than the int8 weight's error (where the int8 product alone picks the wrong token)."""
    from hybridspec.model.head import GreedyHead

    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 4096, 576
    weight = torch.randn(vocab, hidden, generator=gen) * 0.1
    head, int8_wrong = GreedyHead(weight), 0
    for trial in range(64):
        h = torch.randn(1, 3, hidden, generator=gen)
        exact = (h.double() @ weight.double().T)[0]
        for row in range(3):
            # the runner-up gets within 1e-4 of the top logit, above or below it
            a, b = exact[row].topk(2).indices.tolist()
            direction = h[0, row].double() / h[0, row].double().norm() ** 2
            gap = exact[row, a] - exact[row, b] + (1e-4 if trial % 2 else -1e-4)
            weight[b] = (weight[b].double() + gap * direction).float()
        head = GreedyHead(weight)
        exact = (h.double() @ weight.double().T)[0]
        want = exact.argmax(-1)
        assert torch.equal(head(h)[0].argmax(-1), want)
        int8_wrong += int((head.approximate(h[0]).argmax(-1) != want).sum())
    assert int8_wrong > 0  # the ties were close enough to need the float32 recheck


@pytest.mark.parametrize("vocab,hidden", [(1003, 70), (4096, 576)])  # tails: rows past a block of 8, k past 16
def test_int8_head_guesses_within_its_bound_and_rechecks_few(vocab, hidden):
    """The int8 product is the rounded weight's product, every logit of it within |h| bound_i of the float32 one, and
    the float32 recheck takes a few of the vocabulary, for 1 to MAX_ROWS rows."""
    from hybridspec.model.head import GreedyHead

    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    weight[3] = 0.0  # a row of zeros rounds to zeros
    head = GreedyHead(weight)
    rounded = head.q[:, :hidden].float() * head.scales[:, None]
    for rows in range(1, GreedyHead.MAX_ROWS + 1):
        h = torch.randn(rows, hidden, generator=gen)
        guess = head.approximate(h)
        exact = h.double() @ weight.double().T
        torch.testing.assert_close(guess, (h.double() @ rounded.double().T).float(), rtol=1e-5, atol=1e-5)
        assert ((guess.double() - exact).abs() <= h.double().norm(dim=-1, keepdim=True) * head.bounds.double()).all()
        assert torch.equal(head(h).argmax(-1), exact.argmax(-1))
        assert 0 < head.recomputed <= rows * vocab // 10


def test_greedy_head_takes_the_maximum_over_a_grammars_tokens():
    """With token masks (a grammar's allowed tokens, 32 per int32 word) the head's argmax is the exact argmax over the
    allowed tokens, the others -inf: also where the unmasked maximum is disallowed."""
    from hybridspec.model.head import GreedyHead

    gen = torch.Generator().manual_seed(1)
    vocab, hidden = 4096, 64
    weight = torch.randn(vocab, hidden, generator=gen)
    head = GreedyHead(weight)
    h = torch.randn(3, hidden, generator=gen)
    exact = h.double() @ weight.double().T
    allowed = torch.rand(3, vocab, generator=gen) < 0.1
    allowed[:, exact.argmax(-1)] = False  # the unmasked winners are out
    bits = (allowed.view(3, -1, 32).int() << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int64)
    masks = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)  # the words as int32
    logits = head(h, masks)
    assert torch.equal(logits.argmax(-1), exact.masked_fill(~allowed, float("-inf")).argmax(-1))
    assert torch.isinf(logits[~allowed]).all() and torch.isfinite(logits[allowed]).all()


def test_argmax_only_steps_pick_the_tokens_of_full_steps(target):
    """Greedy steps with argmax_only (the int8 head where the CPU runs the product kernel) choose the same tokens as
    steps with full logits, for a batch of rows with drafts up to the head's row limit."""
    from hybridspec.model.head import GreedyHead

    assert (target.greedy_head is not None) == GreedyHead.runs_here(target.lm_head.weight)
    rng = random.Random(3)
    for draft_len in range(GreedyHead.MAX_ROWS):
        cache = target.new_cache(1, 64)
        target.prefill(cache, [[rng.randrange(128) for _ in range(40)]])
        draft = [[rng.randrange(128) for _ in range(draft_len)]]
        full = target.step(cache, [7], draft).logits
        fast = target.step(cache, [7], draft, argmax_only=True).logits
        assert torch.equal(fast.argmax(-1), full.argmax(-1))
        if target.greedy_head is not None:
            assert not torch.equal(fast, full)  # really the int8 head


@pytest.mark.parametrize("rows", [1, 5, 300, 2100])  # 2,100: a chunk the kernel threads
def test_rms_norm_is_the_models_formula_and_each_row_alone(target, tiny_model, rows):
    """The float32 norm (the C kernel where it runs, torch's fused one otherwise) is the Llama formula's up to float32
    rounding, and each row's result is bitwise the same whatever rows it is normed with (a draft's tokens and a plain
    step's agree)."""
    torch.manual_seed(rows)
    x = torch.randn(2, rows, target.hidden_size) * 3
    weight = tiny_model.model.norm.weight
    expected = (x * x.pow(2).mean(-1, keepdim=True).add(target.eps).rsqrt()) * weight
    got = target._rms_norm(x, weight)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, tiny_model.model.norm(x), atol=1e-6, rtol=1e-6)
    assert torch.equal(target._rms_norm(x[:, -1:], weight), got[:, -1:])
    assert torch.equal(target._rms_norm(x[:, ::2], weight), got[:, ::2])  # strided rows


@pytest.mark.parametrize("tokens", [5, 2000])  # 2,000: a prompt chunk, its rows over the threads
@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # with per-head norms, and without
def test_queries_and_keys_normed_and_rotated_in_one_call_are_each_heads(tokens, arch):
    """Qwen3's per-head query and key norms and RoPE, one kernel call over a token's heads in its QKV row, are each
    head's own norm by its weight, then its rotation at the token's position, whatever rows share the call."""
    from hybridspec.model.attention import rotate
    from hybridspec.tools.testing import tiny_causal_lm

    target = TargetModel(tiny_causal_lm(arch))
    layer, hq, hk, hd = target.layers[0], target.num_heads, target.num_kv_heads, target.head_dim
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (hq + 2 * hk) * hd) * 2
    query_key = qkv[:, :(hq + hk) * hd].view(tokens, hq + hk, hd)  # a view with the values' columns between tokens
    rope = target.ropes[layer.rope_kind][torch.randint(0, target.max_seq_len, (tokens,))][:, None]
    got = target._norm_and_rotate(query_key, layer, rope)
    normed = query_key if layer.q_norm is None else torch.cat(
        [torch.rms_norm(query_key[:, :hq], (hd,), layer.q_norm, target.eps),
         torch.rms_norm(query_key[:, hq:], (hd,), layer.k_norm, target.eps)], dim=1)
    torch.testing.assert_close(got, rotate(normed, rope), atol=1e-5, rtol=1e-5)
    assert torch.equal(target._norm_and_rotate(query_key[2:3], layer, rope[2:3]), got[2:3])


def test_a_bfloat16_model_follows_its_reference(tiny_model):
    """Norms and rotary embeddings in a bfloat16 model compute in float32 and return bfloat16, as transformers' do."""
    import copy

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    target = TargetModel(model)
    tokens = [random.Random(7).randrange(3, 128) for _ in range(20)]
    cache = target.new_cache(1, 32)
    target.prefill(cache, [tokens[:-4]])
    out = target.step(cache, [tokens[-4]], [tokens[-3:]])
    assert out.logits.dtype == torch.bfloat16
    want = reference_logits(model, tokens)[-4:].float()
    assert (out.logits[0].float() - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("cached, new, draft, chunk_size", [(0, 9, 4, None), (5, 12, 0, None), (3, 20, 6, 8),
                                                             (0, 16, 3, 8)])
def test_a_prompt_with_its_first_step_is_a_prefill_then_a_step(target, cached, new, draft, chunk_size):
    """One causal pass over a call's uncached tokens, its last token and a chain draft: the logits of `step` after
    `prefill`, and the same cache once the step's accepted slots are committed (chunk boundaries included)."""
    rng = random.Random(cached * 100 + new)
    tokens = [rng.randrange(3, 128) for _ in range(cached + new + 1 + draft)]
    prompt, last, chain = tokens[:cached + new], tokens[cached + new], tokens[cached + new + 1:]
    apart, fused = target.new_cache(1, 64), target.new_cache(1, 64)
    for cache in (apart, fused):
        if cached:
            target.prefill(cache, [prompt[:cached]])
    target.prefill(apart, [prompt[cached:]], chunk_size=chunk_size)
    want = target.step(apart, [last], [chain])
    if chunk_size is None:
        got = target.step_many([StepInput(fused, [last], [chain], prompt=prompt[cached:])])[0]
    else:  # the same pass, chunked: the draft's logits stay in one chunk
        got = target.prefill(fused, [prompt[cached:] + [last] + chain], chunk_size=chunk_size,
                             logits_tail=1 + draft)
        fused.truncate(0, cached + new)
    assert got.logits.shape == want.logits.shape == (1, 1 + draft, target.vocab_size)
    assert torch.allclose(got.logits, want.logits, atol=ATOL)
    assert fused.lengths == apart.lengths == [cached + new]
    keep = list(range(1 + draft // 2))
    for cache in (apart, fused):
        cache.commit(0, keep)
    n = fused.lengths[0]
    assert torch.allclose(fused.keys[:, :, :, :n], apart.keys[:, :, :, :n], atol=ATOL)
    assert torch.allclose(fused.values[:, :, :, :n], apart.values[:, :, :, :n], atol=ATOL)


def test_logits_tail_needs_one_row_of_enough_tokens(target):
    with pytest.raises(ValueError, match="logits_tail"):
        target.prefill(target.new_cache(2, 16), [[5, 6, 7], [8, 9, 10]], logits_tail=2)
    with pytest.raises(ValueError, match="logits_tail"):
        target.prefill(target.new_cache(1, 16), [[5, 6]], logits_tail=3)


@pytest.mark.parametrize("cpu_flash", [True, False], ids=["chunk-apart", "one-mask"])
def test_one_pass_of_parts_of_any_length_matches_separate_passes(target, cpu_flash, monkeypatch):
    """step_many packs parts of different lengths without padding them to one another: a two-row step with a chain
    and a tree, a prompt chunk alone, and a prompt chunk fused with its first step (a tree draft, and the hidden states
    at the prompt's last positions) give what separate passes give, and the chunks go into their caches; with the CPU's
    flash kernel the chunk before a tree attends apart (causal_rows), without it under one mask."""
    monkeypatch.setattr(target.attention, "cpu_flash", cpu_flash and target.attention.cpu_flash)
    rng = random.Random(3)
    seq = lambda n: [rng.randrange(3, 128) for _ in range(n)]  # noqa: E731
    prompts = [seq(9), seq(14), seq(5), seq(7)]
    drafts, parents = [seq(3), seq(5)], [None, [-1, 0, 0, 1, 1]]
    chunk, fused_prompt, fused_draft, fused_parents = seq(23), seq(11), seq(4), [-1, -1, 0, 2]

    def caches():
        step, alone, fused = target.new_cache(2, 64), target.new_cache(1, 64), target.new_cache(1, 64)
        target.prefill(step, [prompts[0][:-1], prompts[1][:-1]])
        target.prefill(alone, [prompts[2]])
        target.prefill(fused, [prompts[3]])
        return step, alone, fused

    step, alone, fused = caches()
    got = target.step_many([StepInput(step, [prompts[0][-1], prompts[1][-1]], drafts, parents),
                            StepInput(alone, [], prompt=chunk),
                            StepInput(fused, [fused_prompt[-1]], [fused_draft], [fused_parents],
                                      prompt=fused_prompt[:-1], drafter_context=4)], return_hidden=True)
    step2, alone2, fused2 = caches()
    want_step = target.step(step2, [prompts[0][-1], prompts[1][-1]], drafts, parents, return_hidden=True)
    target.prefill(alone2, [chunk])
    want_tail = target.prefill(fused2, [fused_prompt[:-1]], drafter_context=4).drafter_features[0]
    want_fused = target.step(fused2, [fused_prompt[-1]], [fused_draft], [fused_parents], return_hidden=True)
    assert got[0].logits.shape == (2, 6, target.vocab_size) and got[1].logits.shape == (1, 0, target.vocab_size)
    assert got[2].logits.shape == (1, 5, target.vocab_size)
    for name in ("logits", "aux_hidden", "final_hidden"):  # real slots: row 0's chain of 3, row 1's tree of 5
        mine, theirs = getattr(got[0], name), getattr(want_step, name)
        assert torch.allclose(mine[0, :4], theirs[0, :4], atol=ATOL) and torch.allclose(mine[1], theirs[1], atol=ATOL)
        assert torch.allclose(getattr(got[2], name), getattr(want_fused, name), atol=ATOL), name
    assert got[0].drafter_features is None and len(got[2].drafter_features) == 1  # the prompt's last 4 positions
    for mine, theirs in zip(got[2].drafter_features[0], want_tail):
        assert mine.shape == theirs.shape and mine.shape[0] == 4 and torch.allclose(mine, theirs, atol=ATOL)
    assert alone.lengths == alone2.lengths == [5 + 23] and fused.lengths == fused2.lengths == [7 + 10]
    alone_again = target.step_many([StepInput(alone, [], prompt=chunk[:6])], argmax_only=True)  # no outputs at all
    assert alone_again[0].logits.shape == (1, 0, target.vocab_size) and alone.lengths == [5 + 23 + 6]
    target.prefill(alone2, [chunk[:6]])
    for mine, theirs in ((alone, alone2), (fused, fused2)):
        n = mine.lengths[0]
        assert torch.allclose(mine.keys[:, :, :, :n], theirs.keys[:, :, :, :n], atol=ATOL)


def test_time_routes_times_every_route_of_every_family():
    """What tune_products measures (and `bench_verify_cost.py --products` prints): per family of same-shaped products,
    the seconds of oneDNN's product at every planned row count and MKL's at the first few, summed over its members."""
    from hybridspec.model.linear import MKL_ROWS, PLANNED_ROWS, Linear, time_routes

    torch.manual_seed(0)
    layers = [Linear(torch.randn(32, 16)), Linear(torch.randn(32, 16)), Linear(torch.randn(8, 32))]
    if layers[0].packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    timed = time_routes(layers, repeats=1)
    assert set(timed) == {layers[0].family, layers[2].family}
    for routes in timed.values():
        assert set(routes) == {(False, m) for m in range(1, PLANNED_ROWS + 1)} | \
            {(True, m) for m in range(1, MKL_ROWS + 1)}
        assert all(seconds > 0 for seconds in routes.values())


def test_calibrate_cli_measures_products_and_verify_cost_again(tiny_model, tmp_path, monkeypatch, capsys):
    """`hybridspec calibrate MODEL` measures both of the machine's tables again, even where they are cached."""
    from hybridspec.model import calibration, linear
    from hybridspec.cli import main

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path / "cache"))
    tiny_model.save_pretrained(tmp_path / "model")
    contexts, tuned = [], []

    def quick(target, *, context, repeats, prefill):
        contexts.append(context)
        return measure_verify_cost(target, (0, 1, 4), context=min(context, 64), repeats=1, prefill=False)

    real_tune = linear.tune_products
    monkeypatch.setattr(calibration, "measure_verify_cost", quick)
    monkeypatch.setattr(linear, "tune_products", lambda linears, **kw: tuned.append(kw) or real_tune(linears, **kw))
    for _ in range(2):
        assert main(["calibrate", str(tmp_path / "model")]) == 0
    # measured again the second time; the tiny model's 512 positions hold one context only (less the largest draft)
    assert len(contexts) == 2 and contexts[0] == contexts[1] < 512
    assert tuned == [{"remeasure": True}] * 2
    out = capsys.readouterr().out
    assert "products (rows -> kernel, rows run):" in out and "64 tokens of context: t(0) =" in out
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").iterdir())
    with pytest.raises(SystemExit, match="--threads must be positive"):
        main(["calibrate", str(tmp_path / "model"), "--threads", "0"])


def _huge_pages_on() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _huge_pages_on(), reason="transparent huge pages are off (or this is not Linux)")
def test_a_kv_cache_is_zeros_in_huge_pages(target):
    """A call's KV cache, megabytes written at once, is zeros in memory advised to be huge pages (`ask_for_huge_pages`:
    one fault per 2 MiB in place of one per 4 KiB), also after it grows: its mapping carries the
    advice (smaps' `hg` flag; whether the pages are huge is then the kernel's, and memory glibc reuses is faulted in
    already)."""
    tokens = -(-(8 << 20) // (target.num_kv_layers * target.num_kv_heads * target.head_dim * 4))
    cache = target.new_cache(1, 64)
    cache.reserve(tokens, exact=True)

    def advised(address: int) -> bool:  # the flags of the mapping that holds `address`, from /proc/self/smaps
        inside = False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and ":" not in head:
                    start, end = (int(part, 16) for part in head.split("-"))
                    inside = start <= address < end
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()[1:]
        return False

    assert not cache.keys.any() and not cache.values.any()
    assert advised(cache.keys.data_ptr() + cache.keys.nbytes // 2)
    assert advised(cache.values.data_ptr() + cache.values.nbytes // 2)
    fresh = KVCache(target.num_kv_layers, 1, target.num_kv_heads, target.head_dim, tokens, torch.float32)
    assert advised(fresh.values.data_ptr() + fresh.values.nbytes // 2) and not fresh.values.any()
