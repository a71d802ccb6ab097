"""The architectures beyond Llama on tiny random models (transformers' own config classes, no download): Qwen2 with
biases, Qwen3 with q/k norms, Qwen3-MoE, sliding windows (Qwen3 half windowed, Mistral all windowed), gpt-oss
(attention sinks, every other layer windowed, MoE with biases and a clamped SwiGLU, YaRN), Gemma 3 (four norms a
layer, GELU, scaled embeddings, local layers windowed with their own rotary base), Qwen3.5 and its MoE (Gated
DeltaNet beside gated attention; their state under speculation: tests/test_delta_net.py), Qwen3-Next (the same
with fused projections). For each, plain
greedy decoding is transformers' `generate` token for token; greedy speculation (random, noisy-oracle and suffix
chains and trees, n-gram) changes no token, one call at a time and batched; chunked prefill and prefix-cache hits
change none; sampling keeps the target's distribution (chi-square, on the MoEs)."""
from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from hybridspec.model.linear import KERNEL_ROWS
from hybridspec.model.target import SUPPORTED_MODEL_TYPES, TargetModel
from hybridspec.runtime.engine import Engine
from hybridspec.tools.testing import TINY_ARCHITECTURES, chi_square_p_value, tiny_causal_lm, tiny_tokenizer

from test_engine import (PROPOSERS, SMALL_VOCAB, SamplingProposer, exact_two_token_distribution, proposer_of,
                         random_prompts)

ARCHITECTURES = [a for a in TINY_ARCHITECTURES if a != "llama"]  # Llama: tests/test_engine.py
WINDOW = 12  # short: the tests' prompts and replies run well past it


def small_ring(target: TargetModel) -> TargetModel:
    """The target with sliding-window rings of the window and 3 inputs (not a prompt chunk's): the tests' sequences
    wrap each ring many times, and their passes of more inputs grow it."""
    if target.ring is not None:
        target.ring = dataclasses.replace(target.ring, slack=3)
    return target


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request):
    model = tiny_causal_lm(request.param, window=WINDOW)
    engine = Engine(small_ring(TargetModel(model)), tiny_tokenizer(128),
                    router=lambda proposals, contexts: list(proposals))
    return request.param, model, engine


def long_prompts(n: int, seed: int) -> list[list[int]]:
    """`random_prompts` and a few longer than the window, repetitive or not."""
    rng = random.Random(seed)
    prompts = random_prompts(n, seed)
    prompts += [[rng.randrange(3, 128) for _ in range(rng.randint(30, 60))] for _ in range(2)]
    unit = [rng.randrange(3, 128) for _ in range(5)]
    return prompts + [(unit * 12)[:47]]


def test_plain_greedy_is_transformers_generate(arch):
    name, model, engine = arch
    for prompt in long_prompts(3, seed=1):
        ours = engine.generate(prompt, max_new_tokens=30, speculate="none")
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                 eos_token_id=engine.tokenizer.eos_token_id, pad_token_id=0)[0, len(prompt):]
        assert ours.token_ids == ref.tolist(), (name, prompt)
    if name == "gpt_oss" and KERNEL_ROWS:  # an AVX-512 CPU: its sinks attend by the attention kernels
        assert engine.target.attention.kernel


@pytest.mark.parametrize("kind", PROPOSERS)
def test_speculative_greedy_is_token_identical(arch, kind):
    name, _, engine = arch
    prompts = long_prompts(4, seed=len(kind))
    references = {tuple(p): engine.generate(p, max_new_tokens=32, speculate="none").token_ids for p in prompts}
    tree = kind.endswith("tree")
    speculate = proposer_of(kind, references)
    alone = [engine.generate(p, max_new_tokens=32, speculate=speculate, num_speculative_tokens=6, tree=tree)
             for p in prompts]
    batched = engine.generate(prompts, max_new_tokens=32, speculate=speculate, num_speculative_tokens=6, tree=tree)
    for prompt, one, many in zip(prompts, alone, batched):
        assert one.token_ids == references[tuple(prompt)], (name, kind, prompt)
        assert many.token_ids == references[tuple(prompt)], (name, kind, prompt)
    if kind.startswith("oracle"):
        assert batched[0].stats.accepted_tokens > 0 and batched[0].stats.tokens_per_step > 1


@pytest.mark.skipif(not KERNEL_ROWS, reason="the small-row product kernel needs an AVX-512 CPU")
@pytest.mark.parametrize("name", TINY_ARCHITECTURES)
def test_bfloat16_valued_weights_stream_in_bfloat16_and_decode_as_transformers(name):
    """A float32 model whose weights are bfloat16 values (a bfloat16 checkpoint loaded into float32): the engine's
    step products stream them in bfloat16 (the packed linear layers, the experts), its prompt chunks' products run on
    AMX tiles where the CPU has them, and greedy decoding is still transformers' `generate` on the float32 model,
    plain and under a noisy-oracle tree and suffix speculation."""
    from hybridspec.model.linear import AMX, WEIGHT_F32

    model = tiny_causal_lm(name, window=WINDOW)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    engine = Engine(small_ring(TargetModel(model)), tiny_tokenizer(128),
                    router=lambda proposals, contexts: list(proposals))
    linears = [lin for lin in engine.target.linears() if lin.packed is not None or lin.amx is not None]
    assert linears and all(lin.weight.dtype == torch.bfloat16 and lin.format != WEIGHT_F32 for lin in linears)
    if AMX:  # prompt chunks on AMX tiles, every shape of 32s (the tiny MoEs' experts too)
        assert all((lin.amx is not None) == (lin.shape[0] % 32 == lin.shape[1] % 32 == 0) for lin in linears)
        assert any(lin.amx is not None for lin in linears)
        assert all(layer.mlp.amx is not None for layer in engine.target.layers if hasattr(layer.mlp, "amx"))
    assert all(layer.mlp.stacked[0].dtype == layer.mlp.stacked[2].dtype == torch.bfloat16
               for layer in engine.target.layers if hasattr(layer.mlp, "stacked"))
    prompts = long_prompts(2, seed=11)
    references = {}
    for prompt in prompts:
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=engine.tokenizer.eos_token_id, pad_token_id=0)[0, len(prompt):]
        references[tuple(prompt)] = ref.tolist()
        assert engine.generate(prompt, max_new_tokens=24, speculate="none").token_ids == ref.tolist(), (name, prompt)
    for kind in ("oracle-tree", "suffix"):
        got = engine.generate(prompts, max_new_tokens=24, speculate=proposer_of(kind, references),
                              num_speculative_tokens=6, tree=kind.endswith("tree"))
        assert [r.token_ids for r in got] == [references[tuple(p)] for p in prompts], (name, kind)


def test_chunked_prefill_and_prefix_hits_change_no_token(arch):
    """Prompts prefilled 5 tokens a step beside other calls, and calls that begin with an earlier call's prompt and
    reply (prefix-cache hits past the window), give the tokens of each call alone."""
    name, model, engine = arch
    chunked = Engine(small_ring(TargetModel(model)), tiny_tokenizer(128), prefill_chunk=5)
    rng = random.Random(5)
    prompts = long_prompts(3, seed=9)
    want = [engine.generate(p, max_new_tokens=20, speculate="none").token_ids for p in prompts]
    got = chunked.generate(prompts, max_new_tokens=20, speculate="suffix")
    assert [r.token_ids for r in got] == want, name
    hits_before = chunked.prefix_cache.counters["hits"]
    for prompt, reply in zip(prompts, want):
        follow = prompt + reply + [rng.randrange(3, 128) for _ in range(4)]
        again = chunked.generate(follow, max_new_tokens=20, speculate="suffix")
        assert again.token_ids == engine.generate(follow, max_new_tokens=20, speculate="none").token_ids, name
        assert again.stats.prefill_tokens < len(follow) - WINDOW
    assert chunked.prefix_cache.counters["hits"] > hits_before


@pytest.mark.parametrize("name,tree", [("qwen3_moe", False), ("qwen3_moe", True), ("gpt_oss", True),
                                       ("qwen3_5_moe", True)])
def test_moe_sampling_keeps_the_target_distribution(name, tree):
    model = tiny_causal_lm(name, vocab_size=SMALL_VOCAB, seed=3, init_std=0.2)
    engine = Engine(TargetModel(model), tiny_tokenizer(SMALL_VOCAB), router=lambda ps, cs: list(ps))
    prompt, eos = [3, 5, 4, 6], engine.tokenizer.eos_token_id
    expected = exact_two_token_distribution(model, prompt, eos)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-9)
    proposer, counts = SamplingProposer(seed=21 + tree, tree=tree, with_logits=True), Counter()
    for call in range(6):
        results = engine.generate([prompt] * 500, max_new_tokens=3, temperature=1.0, speculate=proposer, tree=tree,
                                  seed=100 * call + tree)
        for r in results:
            counts[tuple(r.token_ids[:1]) if r.token_ids[0] == eos else tuple(r.token_ids[:2])] += 1
        assert results[0].stats.accepted_tokens > 0
    assert chi_square_p_value([counts.get(c, 0) for c in expected], list(expected.values())) > 1e-3


@pytest.mark.parametrize("path", ["small-row kernel", "panel kernel", "expert by expert"])
def test_moe_runs_only_the_chosen_experts(path, monkeypatch):
    """A decode step's MoE layers multiply the weights of the experts its tokens chose, no others: by the small-row
    kernel (one call for all chosen experts, a step's path), by the panel kernel (a prompt chunk's) or expert by
    expert; the other experts' weights set to NaN change nothing."""
    from hybridspec.model import layers

    if path != "expert by expert" and not KERNEL_ROWS:
        pytest.skip("the product kernels need an AVX-512 CPU")
    monkeypatch.setattr(layers, "EXPERT_KERNEL_PAIRS", 0 if path == "panel kernel" else 64)
    target = TargetModel(tiny_causal_lm("qwen3_moe"))
    moe, used = target.layers[0].mlp, []
    moe.kernel = path != "expert by expert"

    def counted(expert: int, product):
        return lambda x: (used.append(expert), product(x))[1]

    def chosen(x, weights, chosen, stacked, *rest, real=layers.step_expert_sums):
        used.extend(chosen.unique().tolist()) if stacked is moe.stacked else None
        return real(x, weights, chosen, stacked, *rest)

    def grouped(x, x_rows, panels, bias, n, experts, *rest, real=layers.grouped_expert_products, **options):
        used.extend(experts.tolist()) if panels is moe.panels[0] else None
        return real(x, x_rows, panels, bias, n, experts, *rest, **options)

    monkeypatch.setattr(layers, "step_expert_sums", chosen)
    monkeypatch.setattr(layers, "grouped_expert_products", grouped)
    moe.experts = [(counted(e, gate_up), down) for e, (gate_up, down) in enumerate(moe.experts)]
    cache = target.new_cache(1, 64)
    target.prefill(cache, [[5, 6, 7]])
    assert len(set(used)) > moe.top_k  # three prompt tokens chose more than one token's experts
    used.clear()
    logits = target.step(cache, [9]).logits
    assert len(used) == moe.top_k and len(set(used)) == moe.top_k
    with torch.no_grad():
        for weight in moe.stacked[0], moe.stacked[2], *(moe.panels or ()):
            weight[[e for e in range(len(moe.experts)) if e not in used]] = float("nan")
    assert torch.equal(target.step(cache, [9]).logits, logits)


@pytest.mark.skipif(not KERNEL_ROWS, reason="the product kernels need an AVX-512 CPU")
@pytest.mark.parametrize("name,values", [("qwen3_moe", "float32"), ("gpt_oss", "float32"), ("qwen3_moe", "bfloat16"),
                                         ("gpt_oss", "bfloat16")])
def test_moe_kernel_products_are_the_expert_by_expert_ones(name, values, monkeypatch):
    """The chosen experts' products, by the small-row kernel in one call for the layer (a step's path) and by the
    panel kernel (a prompt chunk's, the activation in it; experts of bfloat16 values: AMX tiles where the CPU has
    them), equal each expert's own products in torch, also where an expert has more rows than one kernel pass takes
    (more than eight of a few tokens' pairs chose it)."""
    from hybridspec.model import layers
    from hybridspec.model.linear import AMX

    model = tiny_causal_lm(name)
    if values == "bfloat16":
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16))
    moe = TargetModel(model).layers[0].mlp
    assert (moe.amx is not None) == (AMX and values == "bfloat16") and (moe.panels is None) == (moe.amx is not None)
    torch.manual_seed(0)
    x, residual = torch.randn(30, moe.stacked[0].shape[2]), torch.randn(30, moe.stacked[0].shape[2])
    chosen, grouped = [], []
    real_chosen, real_grouped = layers.step_expert_sums, layers.grouped_expert_products
    monkeypatch.setattr(layers, "step_expert_sums", lambda *a: chosen.append(a[2].reshape(-1).bincount().max().item())
                        or real_chosen(*a))
    monkeypatch.setattr(layers, "grouped_expert_products", lambda *a, **k: grouped.append(1) or real_grouped(*a, **k))
    with torch.inference_mode():
        small_rows = moe.plus(x, residual)
        monkeypatch.setattr(layers, "EXPERT_KERNEL_PAIRS", 0)
        panels = moe.plus(x, residual)
        moe.kernel = False
        apart = moe.plus(x, residual)
    assert chosen and max(chosen) > KERNEL_ROWS  # the kernel ran, one expert with more rows than a pass takes
    assert len(grouped) == (0 if moe.amx is not None else 2)  # gate_up with its activation, then down
    torch.testing.assert_close(small_rows, apart, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(panels, apart, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not KERNEL_ROWS, reason="the product kernels need an AVX-512 CPU")
@pytest.mark.parametrize("tokens,top_k,dim", [(3, 2, 40), (600, 8, 1000), (64, 4, 16)])
def test_the_expert_sum_kernel_is_index_adds_bits(tokens, top_k, dim):
    """The MoE's weighted sum by `expert_sums` is, to the bit, what transformers computes: zeros index_add_-ed in
    expert order, then the residual added; a step's few tokens on one thread, a chunk's over two (dims that end
    mid-vector)."""
    from hybridspec.model import _products

    torch.manual_seed(tokens)
    chosen = torch.rand(tokens, 32).argsort(dim=-1)[:, :top_k]  # distinct experts a token, in no order
    order = torch.argsort(chosen.reshape(-1), stable=True)
    rows = order // top_k
    products = torch.randn(tokens * top_k, dim) * 10.0 ** torch.randint(-3, 4, (tokens * top_k, 1))  # order shows
    residual = torch.randn(tokens, dim)
    expected = torch.zeros(tokens, dim).index_add_(0, rows, products)
    for res, want in ((None, expected), (residual, residual + expected)):
        out = torch.empty(tokens, dim)
        _products.expert_sums(products.data_ptr(), products.stride(0), order.data_ptr(), tokens, top_k, dim,
                              0 if res is None else res.data_ptr(), out.data_ptr(), 2)
        assert torch.equal(out, want)
    if top_k > 2:  # the order of three or more addends shows in the bits: the test can tell
        assert not torch.equal(torch.zeros(tokens, dim).index_add_(0, rows.flip(0), products.flip(0)), expected)


@pytest.mark.skipif(not KERNEL_ROWS, reason="the product kernels need an AVX-512 CPU")
@pytest.mark.parametrize("activation", ["none", "silu", "clamped swiglu"])
def test_the_panel_kernel_is_each_experts_product(activation):
    """`grouped_expert_products` on shapes that end mid-panel, mid-group and mid-slice (n, the hidden units and k not
    multiples of the kernel's blocks; more panels than a group), experts of 1 to 19 rows gathered by index from x,
    biases and row scales: each expert's rows are their product in torch (with the activation: the hidden units of
    gate_up, in transformers' forms), and bitwise the same under this CPU's blocking and under others (all of k at
    once, in slices of 64 or 256, groups of 1 to 8 panels); and a step's activation of the same sums is the kernel's
    to the bit (a few tokens' experts and a prompt chunk's agree)."""
    from hybridspec.model import layers

    torch.manual_seed(0)
    n, k, units, alpha, limit = 300, 300, 150, 1.702, 2.0  # 10 panels: a group of 8 and one of 2
    gated = activation != "none"
    weight = torch.randn(5, 2 * units if gated else n, k) / 8
    bias = torch.randn(5, weight.shape[1])
    x, counts = torch.randn(40, k), torch.tensor([9, 19, 1, 8, 16])
    experts, starts = torch.tensor([3, 0, 4, 1, 2]), torch.cumsum(counts, 0) - counts
    rows, scales = torch.randint(0, 40, (int(counts.sum()),)), torch.rand(int(counts.sum()))
    panels = layers.pack_panels(weight, gated=gated)

    kind = layers.KERNEL_SILU if activation == "silu" else layers.KERNEL_CLAMPED_SWIGLU

    def products(blocking: tuple[int, int]) -> torch.Tensor:
        if gated:
            return layers.grouped_expert_products(x, rows, panels, layers.gated_order(bias), units, experts, starts,
                                                  counts, activation=(kind, alpha, limit), blocking=blocking)
        return layers.grouped_expert_products(x, rows, panels, bias, n, experts, starts, counts, scales,
                                              blocking=blocking)

    got = products((0, 0))
    for blocking in [(k, 8), (256, 8), (64, 3), (64, 1)]:
        assert torch.equal(products(blocking), got), blocking
    for e, start, count in zip(experts.tolist(), starts.tolist(), counts.tolist()):
        part = slice(start, start + count)
        product = x[rows[part]] @ weight[e].T + bias[e]
        if activation == "none":
            want = product * scales[part, None]
        elif activation == "silu":
            want = torch.nn.functional.silu(product[:, :units]) * product[:, units:]
        else:
            gate, up = product[:, :units].clamp(max=limit), product[:, units:].clamp(-limit, limit)
            want = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        torch.testing.assert_close(got[part], want, atol=2e-5, rtol=2e-5)
    if gated:  # a step's activation (`gated_activation`) of the same sums: the panel kernel's bits
        sums = layers.grouped_expert_products(x, rows, layers.pack_panels(weight), bias, 2 * units, experts, starts,
                                              counts)
        assert torch.equal(layers.gated_activation(sums, (kind, alpha, limit)), got)


@pytest.mark.parametrize("name", ["gpt_oss", "mistral_window"])
def test_a_sliding_window_layer_keeps_only_its_window(name):
    """A sliding-window layer's keys and values live in a ring of the window and one pass's inputs, whatever the
    sequence's length; only the other attention layers' grow with it. Admission counts the ring per row. A ring goes
    back (truncate, a prefix copy) only as far as it still holds the window, and says so otherwise."""
    from hybridspec.model.kv_cache import RingShape

    target = small_ring(TargetModel(tiny_causal_lm(name, window=WINDOW)))
    windowed = sum(layer.window is not None for layer in target.layers)
    assert target.ring == RingShape(windowed, WINDOW, 3) and windowed > 0
    assert target.num_kv_layers == len(target.layers) - windowed  # gpt-oss: every other layer; Mistral: none
    ring_bytes = 2 * windowed * target.num_kv_heads * (WINDOW - 1 + 3) * target.head_dim * 4
    assert target.state_bytes_per_row == ring_bytes
    cache = target.new_cache(1, 256)
    tokens = [random.Random(1).randrange(3, 128) for _ in range(4 * WINDOW)]
    target.prefill(cache, [tokens], chunk_size=2)  # passes of two inputs: the ring keeps its size
    assert cache.ring_keys.shape[3] == WINDOW - 1 + 3 and cache.nbytes == ring_bytes + 2 * cache.keys.nbytes
    assert cache.keys.shape[0] == target.num_kv_layers and cache.keys.shape[3] >= len(tokens)
    reference = tiny_causal_lm(name, window=WINDOW)
    with torch.no_grad():
        want = reference(torch.tensor([tokens + [5]])).logits[0, -2:]  # at the last token, then at 5 after it
    torch.testing.assert_close(target.step(cache, [5]).logits[0, 0], want[1], atol=1e-4, rtol=1e-4)
    # back by one step's scratch: held; back past the ring: refused, nothing changed
    assert cache.usable_prefix(0, len(tokens) - 1) == len(tokens) - 1
    assert cache.usable_prefix(0, len(tokens) - 8) == 0
    with pytest.raises(ValueError, match="sliding-window ring no longer holds"):
        cache.truncate(0, len(tokens) - 8)
    with pytest.raises(ValueError, match="cannot copy"):
        target.new_cache(1, 256).copy_prefix(0, cache, 0, len(tokens) - 8)
    assert cache.lengths == [len(tokens)]
    copy = target.new_cache(1, 256)
    copy.copy_prefix(0, cache, 0, len(tokens) - 1)  # the window before it, into a ring of its own
    cache.truncate(0, len(tokens) - 1)
    for c in (cache, copy):
        torch.testing.assert_close(target.step(c, [tokens[-1]]).logits[0, 0], want[0], atol=1e-4, rtol=1e-4)
    # a pass of more inputs than the slack grows the ring, keeping what it holds
    drafted = target.step(cache, [tokens[-1]], [[5, 6, 7, 8, 9, 10, 11, 12]]).logits[0, :2]
    assert cache.ring_keys.shape[3] >= WINDOW - 1 + 9
    torch.testing.assert_close(drafted, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt_oss", "mistral_window"])
def test_a_windowed_prompt_chunk_by_the_prompt_kernel_is_transformers(name, monkeypatch):
    """Windows of at least the prompt kernel's tile (here 20 positions; gpt-oss's 128): a prompt chunk of a
    windowed layer attends by the kernel over the window's keys in position order, whole prompts and chunks of 7
    whose windows wrap around a small ring (gathered), and decodes transformers' tokens."""
    from hybridspec.model import attention

    if not KERNEL_ROWS:
        pytest.skip("no AVX-512 on this CPU: the prompt kernel does not run")
    windows = []
    kernel = attention._prompt_kernel
    monkeypatch.setattr(attention, "_prompt_kernel", lambda *a, **k: windows.append(a[6] if len(a) > 6 else 0)
                        or kernel(*a, **k))
    model = tiny_causal_lm(name, window=20)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (9, 45, 70)]
    for chunk in (512, 7):
        engine = Engine(small_ring(TargetModel(model)), tiny_tokenizer(128), prefill_chunk=chunk)
        for prompt in prompts:
            with torch.no_grad():
                ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                     eos_token_id=engine.tokenizer.eos_token_id, pad_token_id=0)[0, len(prompt):]
            assert engine.generate(prompt, max_new_tokens=20, speculate="none").token_ids == ref.tolist(), \
                (name, chunk, len(prompt))
    assert 20 in windows


def test_an_unsupported_architecture_names_the_supported_ones():
    import transformers

    config = transformers.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    with pytest.raises(ValueError) as e:
        TargetModel(transformers.Phi3ForCausalLM(config))
    assert "'phi3'" in str(e.value) and all(t in str(e.value) for t in SUPPORTED_MODEL_TYPES)
    assert "vLLM plugin mode" in str(e.value)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "gemma3", "qwen3_5_moe"])
def test_a_bfloat16_checkpoint_directory_loads_into_float32(tmp_path, name):
    """`hybridspec serve DIR` / `Engine.from_pretrained(DIR)`: a saved bfloat16 checkpoint of each family runs in
    float32 and decodes as the same weights do in memory."""
    model = tiny_causal_lm(name, window=WINDOW)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer(128).save_pretrained(tmp_path)
    loaded = Engine.from_pretrained(str(tmp_path), verify_cost=None)
    assert loaded.target.dtype == torch.float32 and loaded.target.config.model_type == model.config.model_type
    # the same weights rounded to bfloat16, in a float32 model whose buffers (rotary frequencies) never were
    reference = tiny_causal_lm(name, window=WINDOW)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    in_memory = Engine(TargetModel(reference), tiny_tokenizer(128), verify_cost=None)
    prompt = long_prompts(1, seed=2)[-1]
    assert loaded.generate(prompt, max_new_tokens=24, speculate="suffix").token_ids == \
        in_memory.generate(prompt, max_new_tokens=24, speculate="none").token_ids


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss experts' weights [experts, in, out] in MXFP4 as its checkpoints hold them: per output row, blocks of 32
    inputs as 4-bit E2M1 codes two to a byte (low nibble first) [experts, out, in / 32, 16] and a power-of-two scale
    each (E8M0, bias 127) [experts, out, in / 32]; and the weights they decode to."""
    fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = weight.transpose(1, 2)
    blocks = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0))
    scaled = blocks / torch.pow(2.0, exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - fp4).abs().argmin(-1)
    codes = magnitude + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    decoded = fp4[magnitude] * torch.where(scaled < 0, -1.0, 1.0) * torch.pow(2.0, exponent)[..., None]
    return packed, (exponent + 127).to(torch.uint8), decoded.reshape(rows.shape).transpose(1, 2).contiguous()


def test_an_mxfp4_gpt_oss_checkpoint_loads_as_its_decoded_weights(tmp_path):
    """gpt-oss as released: experts in MXFP4 (`*_blocks`, `*_scales`, quant_method mxfp4), the rest in full
    precision. transformers decodes them on a CPU; the engine loads that into float32 (every MXFP4 value is exact
    there, and a bfloat16 one) and decodes, under speculation, the tokens of the same model holding the decoded
    weights."""
    from safetensors.torch import save_file

    model = tiny_causal_lm("gpt_oss", window=WINDOW)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[name + "_blocks"], state[name + "_scales"], decoded = to_mxfp4(state.pop(name))
        assert not torch.equal(decoded, model.get_parameter(name))  # 4 bits: the weights move
        model.get_parameter(name).data.copy_(decoded)
    model.config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    model.config.save_pretrained(tmp_path)
    del model.config.quantization_config
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer(128).save_pretrained(tmp_path)
    loaded = Engine.from_pretrained(str(tmp_path), verify_cost=None)
    in_memory = Engine(TargetModel(model), tiny_tokenizer(128), verify_cost=None)
    for got, want in zip(loaded.target.layers, in_memory.target.layers):
        assert all(torch.equal(a, b) for a, b in zip(got.mlp.stacked, want.mlp.stacked))
        # every decoded value is a bfloat16 one: a step streams the experts in bfloat16 where the kernel runs
        assert got.mlp.stacked[0].dtype == (torch.bfloat16 if KERNEL_ROWS else torch.float32)
    prompt = long_prompts(1, seed=3)[-1]
    assert loaded.generate(prompt, max_new_tokens=24, speculate="suffix").token_ids == \
        in_memory.generate(prompt, max_new_tokens=24, speculate="none").token_ids


def test_serve_names_the_supported_architectures_in_one_line(tmp_path):
    """`hybridspec serve DIR` (or `--model DIR`, vLLM's spelling) on an architecture the engine does not run exits with
    the list and the pointer, not a traceback; two different models are refused before anything loads."""
    import transformers

    from hybridspec.cli import main as cli_main

    config = transformers.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    tiny_tokenizer(128).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="two models"):
        cli_main(["serve", "one", "--model", str(tmp_path)])
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit, match="'phi3' is not supported.*gpt_oss.*vLLM plugin mode"):
            cli_main(["serve", "--model", str(tmp_path), "--threads", str(threads)])
        with pytest.raises(SystemExit, match="no config.json"):
            cli_main(["serve", str(tmp_path / "missing"), "--threads", str(threads)])
    finally:
        torch.set_num_threads(threads)


def test_a_qwen3_gguf_file_loads_and_decodes_as_its_weights(tmp_path, monkeypatch):
    """`hybridspec serve model.gguf` beyond SmolLM2: a Qwen3 written to a float32 GGUF (the benchmark's writer, the
    layout llama.cpp reads) is converted once and decodes, speculating, as the same weights do in memory; a file
    transformers reads with the wrong shapes is refused with its reason, not loaded with fresh weights."""
    import transformers
    from bench_architectures import write_gguf

    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path / "cache"))
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                      max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    write_gguf(model, tmp_path / "qwen3.gguf")
    loaded = Engine.from_pretrained(str(tmp_path / "qwen3.gguf"), verify_cost=None)
    assert loaded.target.config.model_type == "qwen3"
    in_memory = Engine(TargetModel(model), tiny_tokenizer(256), verify_cost=None)
    prompt = [5, 6, 7, 8, 9, 10, 11] * 3
    assert loaded.generate(prompt, max_new_tokens=16, speculate="suffix").token_ids == \
        in_memory.generate(prompt, max_new_tokens=16, speculate="none").token_ids
    narrow = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**config.to_dict(), "head_dim": 16}))
    write_gguf(narrow, tmp_path / "narrow.gguf")  # transformers reads no head_dim from a GGUF: 128 is assumed
    with pytest.raises(ValueError, match="transformers cannot read narrow.gguf"):
        Engine.from_pretrained(str(tmp_path / "narrow.gguf"), verify_cost=None)


def test_a_qwen3_5_checkpoint_as_published_loads_its_language_model(tmp_path):
    """Qwen3.5 is published as a vision-language checkpoint (`Qwen3_5ForConditionalGeneration`, the text layers
    under model.language_model): its directory loads as the causal LM the engine runs, and a speculative call gives
    the whole model's greedy tokens."""
    import transformers

    text = tiny_causal_lm("qwen3_5").config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    published = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    published.save_pretrained(tmp_path)
    tiny_tokenizer(128).save_pretrained(tmp_path)
    engine = Engine.from_pretrained(str(tmp_path), verify_cost=None)
    assert engine.target.recurrent is not None
    prompt = [5, 6, 7, 8, 9, 10] * 4
    with torch.no_grad():
        want = published.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
    assert engine.generate(prompt, max_new_tokens=16, speculate="suffix").token_ids == want
