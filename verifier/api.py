"""The verifier's API: check a batch of proposals against the target's logits and return what to commit.

One sequence's target logits are [1 + n, V]: row 0 is the target's next-token distribution after the last committed
token, row 1 + i the one after draft node i (a forward pass over [last token] + the proposal's tokens with tree
attention).
temperature 0 is greedy verification; otherwise lossless rejection sampling against `process_logits(target)`, using
`process_logits(proposal.draft_logits)` as the draft distribution, or a one-hot draft when draft_logits is None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from hybridspec.proposal import Proposal
from hybridspec.verifier import reference
from hybridspec.verifier.reference import check_sampling_params, process_logits

Backend = Literal["auto", "torch", "triton"]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """accepted: indices into proposal.token_ids of the accepted path, root to leaf (maybe empty).
    next_token: the target's token after that path (the correction on a rejection, the bonus token after a leaf)."""

    accepted: list[int]
    next_token: int

    def tokens(self, proposal: Proposal) -> list[int]:
        """The tokens to commit: the accepted draft tokens, then next_token."""
        return [proposal.token_ids[i] for i in self.accepted] + [self.next_token]


def verify(logits: torch.Tensor, proposal: Proposal, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, backend: Backend = "auto") -> VerifyResult:
    """Verify one proposal against the target logits [1 + len(proposal), V]. See `verify_batch`."""
    return verify_batch([logits], [proposal], temperature, top_k, top_p, generator, backend)[0]


def verify_batch(logits: torch.Tensor | Sequence[torch.Tensor], proposals: Sequence[Proposal], temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
                 backend: Backend = "auto") -> list[VerifyResult]:
    """Verify B proposals at once.

    logits: a list of [1 + len(proposals[b]), V] tensors, or one padded [B, R, V] tensor with R >= 1 + the longest
    proposal (rows past 1 + len(proposals[b]) are ignored). Sampling draws its randomness (one uniform per node, one
    race weight per token and sequence) from `generator` on the logits' device, the same way for both backends, so a
    seeded generator gives the same result on either. backend "auto" runs the Triton kernels on CUDA tensors and the
    torch reference otherwise; "triton" on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported.
    """
    check_sampling_params(temperature, top_k, top_p)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if not proposals:
        if len(logits):
            raise ValueError(f"got logits for {len(logits)} sequences but no proposals")
        return []
    target_logits, draft_tokens, parents, num_nodes = _pack(logits, proposals)
    device = target_logits.device
    use_triton = backend == "triton" or (backend == "auto" and device.type == "cuda")
    if use_triton:
        from hybridspec.verifier import kernels as impl
    else:
        impl = reference

    if temperature == 0:
        path, accept_len, next_token = impl.greedy_walk(target_logits.argmax(-1), draft_tokens, parents, num_nodes)
    else:
        target_probs = process_logits(target_logits, temperature, top_k, top_p)
        draft_probs = _draft_probs(proposals, target_logits.shape[1] - 1, target_logits.shape[2], device,
                                   temperature, top_k, top_p)
        batch, num_rows, vocab = target_probs.shape
        # Drawn on the generator's device (a CPU generator works with CUDA logits), in a fixed order.
        random_device = generator.device if generator is not None else device
        uniforms = torch.rand(batch, num_rows - 1, generator=generator, device=random_device).to(device)
        # Exp(1) draws as -log(1 - U) (several times faster than exponential_ on CPU); w = 1 / E, finite.
        exponentials = torch.rand(batch, vocab, generator=generator, device=random_device).neg_().log1p_().neg_()
        race_weights = exponentials.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_().to(device)
        path, accept_len, final_row, use_residual, residual = impl.rejection_walk(
            target_probs, draft_probs, draft_tokens, parents, num_nodes, uniforms)
        next_token = impl.race_sample(target_probs, final_row, use_residual, residual, race_weights)

    rows = torch.cat([accept_len[:, None].long(), next_token[:, None], path.long()], dim=1).tolist()  # one sync
    return [VerifyResult(accepted=row[2:2 + row[0]], next_token=row[1]) for row in rows]


def _pack(logits: torch.Tensor | Sequence[torch.Tensor], proposals: Sequence[Proposal]
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and pad: target logits [B, N + 1, V] and int32 draft_tokens / parents [B, N], num_nodes [B] (N >= 1)."""
    if isinstance(logits, torch.Tensor):
        if logits.dim() != 3:
            raise ValueError(f"padded logits must be [B, R, V], got shape {tuple(logits.shape)}")
        batch_logits = logits
    else:
        logits = list(logits)
        if len(logits) != len(proposals):
            raise ValueError(f"got logits for {len(logits)} sequences but {len(proposals)} proposals")
        for b, (rows, proposal) in enumerate(zip(logits, proposals)):
            if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] != 1 + len(proposal):
                got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
                raise ValueError(f"logits[{b}] must be [1 + len(proposal), V] = [{1 + len(proposal)}, V], got {got}")
        if len({rows.shape[1] for rows in logits}) != 1:
            raise ValueError(f"all logits must share one vocabulary size, got {sorted({r.shape[1] for r in logits})}")
        batch_logits = pad_sequence(logits, batch_first=True)
    batch, num_rows, vocab = batch_logits.shape
    if batch != len(proposals):
        raise ValueError(f"got logits for {batch} sequences but {len(proposals)} proposals")
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary (V = 0)")
    longest = max(len(p) for p in proposals)
    if num_rows < 1 + longest:
        raise ValueError(f"logits have {num_rows} rows but the longest proposal needs 1 + {longest}")
    num_draft = max(longest, 1)  # the kernels want at least one (padding) node
    for b, proposal in enumerate(proposals):
        _check_proposal(proposal, vocab, b)
    draft_tokens = torch.tensor([list(p.token_ids) + [0] * (num_draft - len(p)) for p in proposals], dtype=torch.int32)
    parents = torch.tensor([list(p.parents) + [-1] * (num_draft - len(p)) for p in proposals], dtype=torch.int32)
    num_nodes = torch.tensor([len(p) for p in proposals], dtype=torch.int32)
    if num_rows < 1 + num_draft:  # every proposal is empty: a padding row for the padding node
        batch_logits = torch.cat([batch_logits, batch_logits[:, :1]], dim=1)
    device = batch_logits.device
    return batch_logits[:, :1 + num_draft], draft_tokens.to(device), parents.to(device), num_nodes.to(device)


def _check_proposal(proposal: Proposal, vocab: int, b: int) -> None:
    try:
        proposal.check(vocab)
    except ValueError as e:
        raise ValueError(f"proposal {b}: {e}") from None
    n = len(proposal)
    if proposal.draft_logits is not None and tuple(proposal.draft_logits.shape) != (n, vocab):
        raise ValueError(f"proposal {b}: draft_logits must be [{n}, {vocab}] (one row per draft token, over the target "
                         f"vocabulary), got {tuple(proposal.draft_logits.shape)}")


def _draft_probs(proposals: Sequence[Proposal], num_draft: int, vocab: int, device: torch.device,
                 temperature: float, top_k: int, top_p: float) -> torch.Tensor | None:
    """Processed draft distributions [B, N, V], or None when every proposal is deterministic. In a mixed batch the
    deterministic proposals get one-hot rows, which the rules treat exactly as an absent q."""
    if all(p.draft_logits is None for p in proposals):
        return None
    draft_logits = torch.zeros(len(proposals), num_draft, vocab, device=device)
    for b, proposal in enumerate(proposals):
        if proposal.draft_logits is not None:
            draft_logits[b, :len(proposal)] = proposal.draft_logits.to(device)
    draft_probs = process_logits(draft_logits, temperature, top_k, top_p)
    for b, proposal in enumerate(proposals):
        if proposal.draft_logits is None and len(proposal):
            draft_probs[b] = 0.0
            nodes = torch.arange(len(proposal), device=device)
            draft_probs[b, nodes, torch.tensor(proposal.token_ids, device=device)] = 1.0
    return draft_probs
