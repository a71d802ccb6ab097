"""Offline evaluation of a drafter: the acceptance length greedy speculative decoding would reach on held-out
responses, walked step by step over the target's cached features (`evaluate_acceptance`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridspec.speculators.chains import ChainLayout, full_chain_origins
from hybridspec.speculators.eagle import EagleBase
from hybridspec.speculators.train.batches import chain_logits, make_batch
from hybridspec.speculators.train.data import FeatureStore


def spread(n: int, cap: int | None) -> list[int]:
    """Indices of at most `cap` of n sequences, evenly spaced: a store is ordered by source, so its first ones are not
    a sample."""
    if cap is None or cap >= n:
        return list(range(n))
    return [i * n // cap for i in range(cap)]


def as_target_ids(drafter: Any, ids: Tensor) -> Tensor:
    """Draft-vocabulary ids (EAGLE family) as target ids; the LSTM drafts over the target's vocabulary already."""
    return drafter.draft_to_target()[ids] if isinstance(drafter, EagleBase) else ids


def predicted_ids(drafter: Any, logits: Tensor) -> Tensor:
    """Greedy draft tokens as target ids."""
    return as_target_ids(drafter, logits.argmax(-1))


def walk_acceptance(correct: Tensor, valid_depth: Tensor, is_origin: Tensor, k: int,
                    runner_up: Tensor | None = None) -> tuple[int, int]:
    """(tokens, steps) of greedy speculative decoding over one sequence's slots with chains of k drafts.

    correct [n, max_k]: draft d of the chain from slot i equals the target's greedy token. Decoding starts at the first
    origin; a step from slot i commits 1 + (leading correct drafts, within the text) tokens and the next step starts
    that many slots later, exactly as online decoding with a drafter whose state is rebuilt from target features.
    runner_up [n, max_k]: the target's token is among the drafter's runner-ups at that depth, leaves hung beside the
    chain's token (a tree, `widen_chain`): where the chain is first wrong, one more token is accepted.
    """
    origins = torch.nonzero(is_origin).flatten()
    if origins.numel() == 0:
        return 0, 0
    limit = torch.clamp(valid_depth + 1, max=k)
    run = torch.cumprod(correct[:, :k].int(), dim=1).sum(1)
    if runner_up is not None:
        first_wrong = torch.clamp(run, max=k - 1)
        run = run + ((run < k) & runner_up[torch.arange(run.numel()), first_wrong]).int()
    accepted = [min(int(r), int(m)) for r, m in zip(run, limit)]
    tokens = steps = 0
    pos, end = int(origins[0]), correct.shape[0]
    while pos < end:
        step = 1 + accepted[pos]
        tokens, steps, pos = tokens + step, steps + 1, pos + step
    return tokens, steps


@torch.no_grad()
def evaluate_acceptance(drafter: Any, store: FeatureStore, ks: list[int], indices: list[int] | None = None,
                        slots_per_batch: int = 512, tree_width: int = 1) -> dict[str, Any]:
    """Acceptance length at each K: tokens per decoding step (1 + accepted drafts) of greedy speculative decoding
    through the responses of the given sequences, simulated offline. tree_width > 1 adds "tree_acceptance@K": the
    chain with tree_width - 1 runner-up tokens beside it at each depth (all of them verified).

    Exact for greedy decoding: the drafter sees the target features it would see online, and teacher-forcing the real
    tokens equals feeding its own drafts for as long as they are accepted. (Averaging the acceptance of every position
    instead would overstate it: online, steps start at the hard positions right after a rejection.)
    """
    drafter.eval()
    max_k = max(ks)
    indices = list(range(len(store))) if indices is None else indices
    totals = {k: [0, 0] for k in ks}
    tree_totals = {k: [0, 0] for k in ks}
    depth_correct, depth_count = torch.zeros(max_k), torch.zeros(max_k)
    groups, group, size = [], [], 0
    for index in indices:
        start, end, _ = store.spans[index]
        group.append(index)
        size += end - start
        if size >= slots_per_batch:
            groups.append(group)
            group, size = [], 0
    groups += [group] if group else []
    device = next(drafter.parameters()).device  # batches are built on the CPU, run where the drafter is
    for group in groups:
        # whole sequences: the walk needs every slot of a response
        batch = make_batch(store, group, 1 << 30, max_k)
        layout = ChainLayout(batch.seq_id, batch.positions, full_chain_origins(batch.valid_depth, max_k))
        run_batch, run_layout = (batch, layout) if device.type == "cpu" else (batch.to(device), layout.to(device))
        correct = torch.zeros(len(batch), max_k, dtype=torch.bool)
        runner_up = torch.zeros(len(batch), max_k, dtype=torch.bool)
        for d, (lg, origins) in enumerate(zip(chain_logits(drafter, run_batch, run_layout), layout.origins)):
            hit = (predicted_ids(drafter, lg) == run_batch.target_top1[run_layout.origins[d] + d]).cpu()
            correct[origins, d] = hit
            if tree_width > 1:
                top = as_target_ids(drafter, lg.topk(tree_width, dim=-1).indices).cpu()  # [n, width], greedy first
                runner_up[origins, d] = (top[:, 1:] == batch.target_top1[origins + d][:, None]).any(1)
            counted = batch.loss_mask[origins + d]
            depth_correct[d] += (hit & counted).sum()
            depth_count[d] += counted.sum()
        for s in range(len(group)):
            rows = batch.seq_id == s
            for k in ks:
                tokens, steps = walk_acceptance(correct[rows], batch.valid_depth[rows], batch.is_origin[rows], k)
                totals[k][0] += tokens
                totals[k][1] += steps
                if tree_width > 1:
                    tokens, steps = walk_acceptance(correct[rows], batch.valid_depth[rows], batch.is_origin[rows], k,
                                                    runner_up[rows])
                    tree_totals[k][0] += tokens
                    tree_totals[k][1] += steps
    result: dict[str, Any] = {f"acceptance@{k}": totals[k][0] / totals[k][1] if totals[k][1] else float("nan")
                              for k in ks}
    if tree_width > 1:
        result.update({f"tree_acceptance@{k}": tree_totals[k][0] / tree_totals[k][1] if tree_totals[k][1]
                       else float("nan") for k in ks})
    result["steps"] = {k: totals[k][1] for k in ks}
    result["accuracy_by_depth"] = [round(float(c / max(n, 1)), 4) for c, n in zip(depth_correct, depth_count)]
    return result
