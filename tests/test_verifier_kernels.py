"""Triton kernels against the torch reference, bit for bit on the same random inputs.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (~1 ms per program instance and op: grids and
vocabularies stay small). Triton picks interpreter or compiler when `triton` is first imported (and reads the variable
again while interpreting), so this module sets it before importing triton and restores it after its last test. If an
earlier test module already imported triton without it, the same tests run in a fresh process instead
(`test_in_fresh_process`). With a GPU they run compiled, on CUDA tensors.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ON_GPU = torch.cuda.is_available()
_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from hybridspec.proposal import Proposal  # noqa: E402
from hybridspec.verifier import kernels as kernel_module  # noqa: E402
from hybridspec.verifier import process_logits, reference, verify_batch  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
RUNNABLE_HERE = ON_GPU or all(type(fn).__name__ == "InterpretedFunction"
                              for fn in (triton.language.standard.max, kernel_module._greedy_walk_kernel))
in_process = pytest.mark.skipif(not RUNNABLE_HERE, reason="triton was imported before TRITON_INTERPRET was set: "
                                                          "test_in_fresh_process runs these tests")


@pytest.fixture(scope="module", autouse=True)
def restore_triton_interpret():
    yield
    if _PREVIOUS_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET


@pytest.fixture(scope="module")
def kernels():
    return kernel_module


def random_batch(seed: int, batch: int, num_draft: int, vocab: int, shape: str, token_range: int | None = None):
    """Padded draft tokens / parents [B, N] (int32) and num_nodes [B], with some sequences shorter than N or empty.
    shape: "chain", "tree" (random parents) or "wide" (every node a child of the root: many sibling rejections)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.empty(batch, num_draft, dtype=torch.int32)
    for b in range(batch):
        for i in range(num_draft):
            parents[b, i] = {"chain": i - 1, "wide": -1}.get(shape, int(torch.randint(-1, i, (1,), generator=g)))
    tokens = torch.randint(0, token_range or vocab, (batch, num_draft), generator=g, dtype=torch.int32)
    num_nodes = torch.randint(0, num_draft + 1, (batch,), generator=g, dtype=torch.int32)
    num_nodes[0], num_nodes[-1] = num_draft, 0
    return tokens.to(DEVICE), parents.to(DEVICE), num_nodes.to(DEVICE), g


def assert_walks_equal(got: tuple, want: tuple) -> None:
    for name, x, y in zip(["path", "accept_len", "final_row", "use_residual"], got[:4], want[:4]):
        assert torch.equal(x.cpu(), y.cpu()), name
    used = want[3].bool()
    # Residual masses are sums in a different order: in trees a later sibling's residual may differ in the last ulp.
    torch.testing.assert_close(got[4][used], want[4][used], rtol=1e-6, atol=1e-9)


@in_process
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_walk_matches_reference(kernels, shape: str) -> None:
    tokens, parents, num_nodes, g = random_batch(0, batch=8, num_draft=7, vocab=50, shape=shape, token_range=2)
    target_argmax = (torch.rand(8, 8, generator=g) < 0.2).to(DEVICE)  # mostly token 0: long matches are common
    tokens = tokens * (torch.rand(8, 7, generator=g) < 0.3).to(DEVICE)
    got = kernels.greedy_walk(target_argmax, tokens, parents, num_nodes)
    want = reference.greedy_walk(target_argmax, tokens, parents, num_nodes)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    assert want[1].max() >= 2  # deep acceptances were exercised


@in_process
@pytest.mark.parametrize("draft", ["model_q", "deterministic", "one_hot_rows"])
@pytest.mark.parametrize("shape", ["chain", "tree", "wide"])
def test_rejection_walk_matches_reference(kernels, shape: str, draft: str) -> None:
    batch, num_draft, vocab = 12, 6, 37
    # The drafts' tokens are the likely ones under both distributions: paths get long, and in wide trees the later
    # siblings' tests depend on the residual mass left by the earlier ones.
    likely = 4 if shape == "wide" else 2
    tokens, parents, num_nodes, g = random_batch(1, batch, num_draft, vocab, shape, token_range=likely)
    bias = torch.zeros(vocab)
    bias[:likely] = 5.0
    target = process_logits(torch.randn(batch, num_draft + 1, vocab, generator=g) * 0.5 + bias, 0.9, top_k=12)
    target = target.to(DEVICE)
    if draft == "model_q":
        # The drafter over-weights token 0: it is often rejected, and the residual then holds the other tokens.
        draft_bias = bias.clone()
        draft_bias[0] += 2.0
        draft_logits = torch.randn(batch, num_draft, vocab, generator=g) * 0.5 + draft_bias
        draft_probs = process_logits(draft_logits, 0.9, top_k=12).to(DEVICE)
        # Sequence 1 drafts from the target itself (q == p) and its first token has probability 0: it is rejected and
        # the residual max(0, p - q) is all zeros, so the next token comes from p itself.
        num_nodes[1] = num_draft
        target[1, 0, tokens[1, 0]] = 0.0
        target[1, 0] /= target[1, 0].sum()
        draft_probs[1] = target[1, parents[1].long() + 1]
    elif draft == "one_hot_rows":
        draft_probs = torch.nn.functional.one_hot(tokens.long(), vocab).float()
    else:
        draft_probs = None
    uniforms = torch.rand(batch, num_draft, generator=g).to(DEVICE)
    got = kernels.rejection_walk(target, draft_probs, tokens, parents, num_nodes, uniforms)
    want = reference.rejection_walk(target, draft_probs, tokens, parents, num_nodes, uniforms)
    assert_walks_equal(got, want)
    if shape == "wide":  # a later sibling accepted after earlier ones were rejected
        assert (want[0][:, 0] > 0).any()
    else:  # long paths and draws from a residual
        assert want[1].max() >= 2 and want[3].any()
    if draft == "model_q" and shape == "chain":
        assert want[1][1] == 0 and want[3][1] == 0


@in_process
def test_rejection_walk_multi_chunk_vocab(kernels) -> None:
    """V larger than one BLOCK_V: the residual and its mass are built chunk by chunk."""
    batch, num_draft, vocab = 2, 3, 2500
    tokens, parents, num_nodes, g = random_batch(2, batch, num_draft, vocab, shape="tree")
    target = process_logits(torch.randn(batch, num_draft + 1, vocab, generator=g), 1.0).to(DEVICE)
    draft_probs = process_logits(torch.randn(batch, num_draft, vocab, generator=g), 1.0).to(DEVICE)
    uniforms = torch.full((batch, num_draft), 0.999, device=DEVICE)  # reject (almost) everything: residual passes run
    got = kernels.rejection_walk(target, draft_probs, tokens, parents, num_nodes, uniforms)
    want = reference.rejection_walk(target, draft_probs, tokens, parents, num_nodes, uniforms)
    assert_walks_equal(got, want)
    assert want[3][0] == 1


@in_process
@pytest.mark.parametrize("vocab", [37, 2500])
def test_race_sample_matches_reference(kernels, vocab: int) -> None:
    batch, num_rows = 6, 4
    g = torch.Generator().manual_seed(3)
    target = process_logits(torch.randn(batch, num_rows, vocab, generator=g), 1.0, top_p=0.9)
    residual = torch.rand(batch, vocab, generator=g) * (torch.rand(batch, vocab, generator=g) < 0.3)
    final_row = torch.randint(0, num_rows, (batch,), generator=g, dtype=torch.int32)
    use_residual = torch.tensor([0, 1] * (batch // 2), dtype=torch.int32)
    race = torch.empty(batch, vocab).exponential_(generator=g).reciprocal_()
    race[0] = 1.0  # row 0: pure argmax of the target row, ties included
    target[0, final_row[0]] = 0.0
    target[0, final_row[0], [vocab - 1, 5, vocab // 2]] = 1 / 3
    inputs = [t.to(DEVICE) for t in (target, final_row, use_residual, residual, race)]
    got = kernels.race_sample(*inputs)
    want = reference.race_sample(*inputs)
    assert torch.equal(got, want)
    assert want[0] == 5  # the lowest token id among tied maxima


def mixed_proposals(seed: int, vocab: int, copies: int = 2) -> tuple[list[torch.Tensor], list[Proposal]]:
    """Chains, trees and empty proposals, half with draft logits, with logits that make the drafts' tokens likely."""
    g = torch.Generator().manual_seed(seed)
    shapes = [[-1, 0, 1, 2], [-1, -1, 0, 0, 1, 3, 3], [], [-1], [-1, -1, -1, 1]]
    proposals, logits = [], []
    for i, parents in enumerate(shapes * copies):
        tokens = torch.randint(0, 2, (len(parents),), generator=g).tolist()
        draft = torch.randn(len(parents), vocab, generator=g).to(DEVICE) if i % 2 else None
        proposals.append(Proposal(token_ids=tokens, parents=parents, draft_logits=draft))
        rows = torch.randn(len(parents) + 1, vocab, generator=g)
        rows[:, 0] += 4.0
        rows[:, 1] += 3.0
        logits.append(rows.to(DEVICE))
    return logits, proposals


@in_process
@pytest.mark.parametrize("params", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 0.9)], ids=["greedy", "t1", "t0.7-k5-p0.9"])
def test_verify_batch_backends_agree(kernels, params: tuple[float, int, float]) -> None:
    logits, proposals = mixed_proposals(4, vocab=29)
    results = {backend: verify_batch(logits, proposals, *params, generator=torch.Generator(DEVICE).manual_seed(5),
                                     backend=backend) for backend in ("torch", "triton")}
    assert results["triton"] == results["torch"]
    assert max(len(r.accepted) for r in results["torch"]) >= 2


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the interpreter covers the rules at small sizes)")
@pytest.mark.parametrize("params", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 0.9)],
                         ids=["greedy", "t1", "t0.7-k50-p0.9"])
def test_cuda_large_vocab_backends_agree(params: tuple[float, int, float]) -> None:
    logits, proposals = mixed_proposals(6, vocab=128_256, copies=13)
    results = [verify_batch(logits, proposals, *params, generator=torch.Generator("cuda").manual_seed(7), backend=b)
               for b in ("triton", "torch")]
    assert results[0] == results[1]


def test_kernels_compile_for_cuda() -> None:
    """Compile every kernel variant to a cubin for sm_90 (no GPU needed) in a process without the interpreter: the
    compiled path type-checks and lowers, and the launch options keep multiply-adds unfused like the reference."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from hybridspec.verifier import kernels
        ptr = {"i32": "*i32", "i64": "*i64", "f32": "*fp32"}
        walk = ["f32", "f32", "i32", "i32", "i32", "f32", "i32", "i32", "i32", "i32", "f32"]
        block_v, warps = kernels._BLOCK_V, kernels._VOCAB_WARPS
        variants = [
            (kernels._greedy_walk_kernel, ["i32"] * 6 + ["i64"], ["N"], {"BLOCK_N": 16}, 1),
            (kernels._rejection_walk_kernel, walk, ["N", "V", "residual_eps"],
             {"HAS_DRAFT_PROBS": True, "BLOCK_N": 16, "BLOCK_V": block_v}, warps),
            (kernels._rejection_walk_kernel, walk, ["N", "V", "residual_eps"],
             {"HAS_DRAFT_PROBS": False, "BLOCK_N": 1, "BLOCK_V": 64}, warps),
            (kernels._race_sample_kernel, ["f32", "i32", "i32", "f32", "f32", "i64"], ["num_rows", "V"],
             {"BLOCK_V": block_v}, warps),
        ]
        for fn, pointers, scalars, constexprs, num_warps in variants:
            names = fn.arg_names
            signature = {name: ptr[kind] for name, kind in zip(names, pointers)}
            signature |= {name: "fp32" if name == "residual_eps" else "i32" for name in scalars}
            signature |= {name: "constexpr" for name in constexprs}
            assert list(signature) == names, (list(signature), names)
            compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                      options=kernels._LAUNCH_OPTIONS | {"num_warps": num_warps})
            assert compiled.asm["cubin"] and "fma.rn.f32" not in compiled.asm["ptx"], fn.__name__
        print("compiled", len(variants))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "compiled 4" in out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(RUNNABLE_HERE, reason="the kernel tests ran in this process")
def test_in_fresh_process() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "not compile_for_cuda"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "triton was imported before" not in out.stdout
