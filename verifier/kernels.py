"""Triton kernels for the verification rules: the same functions, arguments and results as `reference.py`.

One program per sequence. Node data (tokens, parents, p and q at each node's token, uniforms) is loaded once into
registers; the walk over nodes then touches O(V) memory only after a rejection (residual update) and once at the end
(the exponential race), in BLOCK_V chunks. Floating-point operations mirror the reference one for one (no FMA
contraction), so results are identical given the same inputs.

Imported lazily by `hybridspec.verifier` (only for CUDA tensors or backend="triton"): triton is an optional dependency.
Under TRITON_INTERPRET=1 (set before triton is first imported) the kernels run on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridspec.verifier.reference import RESIDUAL_EPS

_BLOCK_V = 4096  # vocabulary chunk: 16 floats per thread at 8 warps
_VOCAB_WARPS = 8
_LAUNCH_OPTIONS = {"enable_fp_fusion": False}  # a fused multiply-add would round differently from the reference


@triton.jit
def _greedy_walk_kernel(target_argmax_ptr, draft_tokens_ptr, parents_ptr, num_nodes_ptr,
                        path_ptr, accept_len_ptr, next_token_ptr,
                        N, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_nodes_ptr + b)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n
    tokens = tl.load(draft_tokens_ptr + b * N + offs, mask=valid, other=-1)
    parents = tl.load(parents_ptr + b * N + offs, mask=valid, other=-2)
    target_at_parent = tl.load(target_argmax_ptr + b * (N + 1) + parents + 1, mask=valid, other=-1)
    matches = valid & (tokens == target_at_parent)
    cur = -1
    length = 0
    # One step per depth: the first matching child of the current node, if any (BLOCK_N = none).
    for _ in range(0, N):
        child = tl.min(tl.where(matches & (parents == cur), offs, BLOCK_N), axis=0)
        if child < BLOCK_N:
            tl.store(path_ptr + b * N + length, child)
            length += 1
            cur = child
    tl.store(accept_len_ptr + b, length)
    tl.store(next_token_ptr + b, tl.load(target_argmax_ptr + b * (N + 1) + cur + 1))


@triton.jit
def _rejection_walk_kernel(target_probs_ptr, draft_probs_ptr, draft_tokens_ptr, parents_ptr, num_nodes_ptr,
                           uniforms_ptr, path_ptr, accept_len_ptr, final_row_ptr, use_residual_ptr, residual_ptr,
                           N, V, residual_eps,
                           HAS_DRAFT_PROBS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_nodes_ptr + b)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n
    tokens = tl.load(draft_tokens_ptr + b * N + offs, mask=valid, other=0)
    parents = tl.load(parents_ptr + b * N + offs, mask=valid, other=-2)
    uniforms = tl.load(uniforms_ptr + b * N + offs, mask=valid, other=1.0)
    target_base = target_probs_ptr + b * (N + 1) * V
    p_fresh = tl.load(target_base + (parents + 1).to(tl.int64) * V + tokens, mask=valid, other=0.0)
    if HAS_DRAFT_PROBS:
        q_token = tl.load(draft_probs_ptr + (b * N + offs) * V + tokens, mask=valid, other=1.0)
    else:
        q_token = tl.full([BLOCK_N], 1.0, tl.float32)
    residual_row = residual_ptr + b * V
    vocab = tl.arange(0, BLOCK_V)

    cur = -1
    length = 0
    mass = 1.0
    fresh = 1  # 1: the residual is the target row cur + 1 itself (mass 1), 0: it lives in residual_row
    for j in range(0, N):
        at_j = offs == j
        parent = tl.sum(tl.where(at_j, parents, 0), axis=0)
        if (j < n) & (parent == cur):
            x = tl.sum(tl.where(at_j, tokens, 0), axis=0)
            if fresh == 1:
                p_x = tl.sum(tl.where(at_j, p_fresh, 0.0), axis=0)
            else:
                p_x = tl.load(residual_row + x)
            u = tl.sum(tl.where(at_j, uniforms, 0.0), axis=0)
            q_x = tl.sum(tl.where(at_j, q_token, 0.0), axis=0)
            if u * q_x * mass < p_x:
                tl.store(path_ptr + b * N + length, j)
                length += 1
                cur = j
                mass = 1.0
                fresh = 1
            else:
                # r <- max(0, r - S * q_j) and its new mass, chunk by chunk, in place.
                source_row = target_base + (cur + 1).to(tl.int64) * V
                new_mass = 0.0
                for v0 in range(0, V, BLOCK_V):
                    cols = v0 + vocab
                    in_vocab = cols < V
                    if fresh == 1:
                        r = tl.load(source_row + cols, mask=in_vocab, other=0.0)
                    else:
                        r = tl.load(residual_row + cols, mask=in_vocab, other=0.0)
                    if HAS_DRAFT_PROBS:
                        q = tl.load(draft_probs_ptr + (b * N + j) * V + cols, mask=in_vocab, other=0.0)
                    else:
                        q = tl.where(cols == x, 1.0, 0.0)
                    r = tl.maximum(r - mass * q, 0.0)
                    tl.store(residual_row + cols, r, mask=in_vocab)
                    new_mass += tl.sum(r, axis=0)
                # The next sibling's p_x load and residual pass read elements that other threads wrote.
                tl.debug_barrier()
                if new_mass <= residual_eps:
                    mass = 1.0
                    fresh = 1
                else:
                    mass = new_mass
                    fresh = 0
    tl.store(accept_len_ptr + b, length)
    tl.store(final_row_ptr + b, cur + 1)
    tl.store(use_residual_ptr + b, 1 - fresh)


@triton.jit
def _race_sample_kernel(target_probs_ptr, final_row_ptr, use_residual_ptr, residual_ptr, race_weights_ptr,
                        next_token_ptr, num_rows, V, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(final_row_ptr + b).to(tl.int64)
    use_residual = tl.load(use_residual_ptr + b)
    target_row = target_probs_ptr + (b * num_rows + row) * V
    vocab = tl.arange(0, BLOCK_V)
    best_score = -1.0
    best_token = 0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + vocab
        in_vocab = cols < V
        if use_residual == 1:
            r = tl.load(residual_ptr + b * V + cols, mask=in_vocab, other=0.0)
        else:
            r = tl.load(target_row + cols, mask=in_vocab, other=0.0)
        w = tl.load(race_weights_ptr + b * V + cols, mask=in_vocab, other=0.0)
        score = tl.where(in_vocab, r * w, -1.0)
        chunk_best = tl.max(score, axis=0)
        # Strictly greater: on ties the earlier chunk (lower token id) wins, as torch.argmax does.
        if chunk_best > best_score:
            best_score = chunk_best
            best_token = v0 + tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(next_token_ptr + b, best_token)


def greedy_walk(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.greedy_walk`."""
    batch, num_rows = target_argmax.shape
    num_draft = num_rows - 1
    device = target_argmax.device
    path = torch.full((batch, num_draft), -1, dtype=torch.int32, device=device)
    accept_len = torch.empty(batch, dtype=torch.int32, device=device)
    next_token = torch.empty(batch, dtype=torch.int64, device=device)
    if batch:
        _greedy_walk_kernel[(batch,)](
            target_argmax.to(torch.int32).contiguous(), _int32(draft_tokens), _int32(parents), _int32(num_nodes),
            path, accept_len, next_token, num_draft, BLOCK_N=_block_n(num_draft), num_warps=1, **_LAUNCH_OPTIONS)
    return path, accept_len, next_token


def rejection_walk(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                   parents: torch.Tensor, num_nodes: torch.Tensor, uniforms: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.rejection_walk`."""
    batch, num_rows, vocab = target_probs.shape
    num_draft = num_rows - 1
    device = target_probs.device
    path = torch.full((batch, num_draft), -1, dtype=torch.int32, device=device)
    accept_len = torch.empty(batch, dtype=torch.int32, device=device)
    final_row = torch.empty(batch, dtype=torch.int32, device=device)
    use_residual = torch.empty(batch, dtype=torch.int32, device=device)
    residual = torch.empty(batch, vocab, dtype=torch.float32, device=device)  # written in full before any use
    target_probs = target_probs.float().contiguous()
    if batch:
        _rejection_walk_kernel[(batch,)](
            target_probs, target_probs if draft_probs is None else draft_probs.float().contiguous(),
            _int32(draft_tokens), _int32(parents), _int32(num_nodes), uniforms.float().contiguous(),
            path, accept_len, final_row, use_residual, residual, num_draft, vocab, RESIDUAL_EPS,
            HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_N=_block_n(num_draft), BLOCK_V=_block_v(vocab),
            num_warps=_VOCAB_WARPS, **_LAUNCH_OPTIONS)
    return path, accept_len, final_row, use_residual, residual


def race_sample(target_probs: torch.Tensor, final_row: torch.Tensor, use_residual: torch.Tensor, residual: torch.Tensor,
                race_weights: torch.Tensor) -> torch.Tensor:
    """See `reference.race_sample`."""
    batch, num_rows, vocab = target_probs.shape
    next_token = torch.empty(batch, dtype=torch.int64, device=target_probs.device)
    if batch:
        _race_sample_kernel[(batch,)](
            target_probs.float().contiguous(), _int32(final_row), _int32(use_residual), residual.float().contiguous(),
            race_weights.float().contiguous(), next_token, num_rows, vocab, BLOCK_V=_block_v(vocab),
            num_warps=_VOCAB_WARPS, **_LAUNCH_OPTIONS)
    return next_token


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _block_n(num_draft: int) -> int:
    return triton.next_power_of_2(max(num_draft, 1))


def _block_v(vocab: int) -> int:
    return min(_BLOCK_V, triton.next_power_of_2(vocab))
