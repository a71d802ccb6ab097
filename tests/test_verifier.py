"""Verification rules (torch reference path): greedy against a brute force, sampling against the target distribution.

The target and the drafter are synthetic trigram models over a tiny vocabulary (the logits at a position depend on the
two previous tokens), so the target's exact next-token and next-two-token distributions are known in closed form.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridspec.proposal import Proposal
from hybridspec.verifier import VerifyResult, process_logits, verify, verify_batch
from hybridspec.tools.testing import chi_square_p_value
from hybridspec.verifier import reference

V = 6
ROOT = (0, 1)  # the last two committed tokens


class Trigram:
    """Next-token logits as a function of the last two tokens."""

    def __init__(self, seed: int, scale: float = 1.5, base: "Trigram | None" = None, noise: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(V, V, V, generator=g) * scale
        self.table = table if base is None else base.table + noise * table / scale

    def logits(self, states: torch.Tensor) -> torch.Tensor:  # states [..., 2] -> [..., V]
        return self.table[states[..., 0], states[..., 1]]


TARGET = Trigram(seed=1)
DRAFT = Trigram(seed=2, base=TARGET, noise=1.2)  # model-like: correlated with the target, clearly different


# ------------------------------------------------------------------------------------------------------------- helpers


def brute_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """process_logits for one row, written independently in float64."""
    if temperature == 0:
        out = np.zeros(len(logits))
        out[int(np.argmax(logits))] = 1.0
        return out
    z = logits.astype(np.float64) / temperature
    keep = np.ones(len(z), dtype=bool)
    if 0 < top_k < len(z):
        keep = z >= np.sort(z)[::-1][top_k - 1]
    probs = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        mass, last_kept = 0.0, None
        for p in sorted(probs, reverse=True):
            if mass >= top_p:
                break
            mass, last_kept = mass + p, p
        probs = np.where(probs >= last_kept, probs, 0.0)  # ties with the last kept token are kept
        probs /= probs.sum()
    return probs


def root_paths(parents: list[int]) -> list[list[int]]:
    """For every node, the node indices from the root down to it."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    return paths


def random_tree(rng: np.random.Generator, n: int, chain: bool) -> list[int]:
    return [i - 1 for i in range(n)] if chain else [int(rng.integers(-1, i)) for i in range(n)]


def node_states(parents: list[int], tokens: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """[T, n, 2]: the (last two tokens) state after each node, for T trials sharing one tree shape."""
    states = torch.empty(tokens.shape[0], len(parents), 2, dtype=torch.long)
    for i, p in enumerate(parents):
        parent_state = root if p < 0 else states[:, p]
        states[:, i, 0] = parent_state[:, 1]
        states[:, i, 1] = tokens[:, i]
    return states


def target_rows(parents: list[int], tokens: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """The target's logits [T, 1 + n, V] for a forward pass over [last token] + draft tokens."""
    states = torch.cat([root[:, None], node_states(parents, tokens, root)], dim=1)
    return TARGET.logits(states)


# ----------------------------------------------------------------------------------------------------- process_logits


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6),
                                                     (0.8, 5, 0.75), (2.0, 1, 1.0), (1.0, 0, 1e-6), (0.0, 0, 1.0),
                                                     (1.0, 50, 1.0)])
def test_process_logits_matches_brute_force(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(7, 12, generator=torch.Generator().manual_seed(0)) * 2
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie at the top
    probs = process_logits(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32
    for row, got in zip(logits.numpy(), probs.numpy()):
        np.testing.assert_allclose(got, brute_process(row, temperature, top_k, top_p), atol=2e-6)


def test_process_logits_keeps_ties() -> None:
    logits = torch.tensor([1.0, 2.0, 2.0, 3.0, 0.0])
    assert (process_logits(logits, 1.0, top_k=2) > 0).tolist() == [False, True, True, True, False]
    assert (process_logits(logits, 1.0, top_p=0.7) > 0).tolist() == [False, True, True, True, False]


def test_top_p_on_a_large_flat_vocabulary() -> None:
    """Most of a flat distribution is needed to reach top_p: the threshold search widens to a full sort."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * 0.1
    for row, got in zip(logits.numpy(), process_logits(logits, 1.0, top_p=0.95).numpy()):
        np.testing.assert_allclose(got, brute_process(row, 1.0, 0, 0.95), atol=1e-7)
        assert 4000 < (got > 0).sum() < 5000


# --------------------------------------------------------------------------------------------------------------- greedy


def test_greedy_chain_constructed() -> None:
    logits = torch.full((4, V), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 5] = logits[3, 1] = 1.0  # argmax per row: 2, 4, 5, 1
    assert verify(logits, Proposal.chain([2, 4, 5])) == VerifyResult([0, 1, 2], 1)  # all accepted + bonus
    assert verify(logits, Proposal.chain([2, 4, 0])) == VerifyResult([0, 1], 5)  # rejected at 2: correction
    assert verify(logits, Proposal.chain([3, 4, 5])) == VerifyResult([], 2)
    assert verify(logits[:1], Proposal.empty()) == VerifyResult([], 2)
    assert verify(logits, Proposal.chain([2, 4, 0])).tokens(Proposal.chain([2, 4, 0])) == [2, 4, 5]


def test_greedy_tree_constructed() -> None:
    # root -> {0: 3, 1: 2}; 1 -> {2: 0, 3: 4}; 3 -> {4: 5}; 0 -> {5: 4}
    proposal = Proposal(token_ids=[3, 2, 0, 4, 5, 4], parents=[-1, -1, 1, 1, 3, 0])
    # The target's argmax: 2 at the root (row 0), 4 after node 1 (row 2), 5 after node 3 (row 4), 1 after node 4
    # (row 5); 0 elsewhere.
    argmax_at_row = {0: 2, 2: 4, 4: 5, 5: 1}
    logits = torch.zeros(7, V)
    for row, token in argmax_at_row.items():
        logits[row, token] = 1.0
    assert verify(logits, proposal) == VerifyResult([1, 3, 4], 1)


def test_greedy_tree_takes_first_matching_sibling() -> None:
    # Two children with the target's token; only the second one's subtree would continue: the rule takes the first.
    proposal = Proposal(token_ids=[2, 2, 4], parents=[-1, -1, 1])
    logits = torch.zeros(4, V)
    logits[0, 2] = logits[1, 3] = logits[2, 4] = 1.0
    assert verify(logits, proposal) == VerifyResult([0], 3)


@pytest.mark.parametrize("chain", [True, False])
def test_greedy_random_matches_brute_force(chain: bool) -> None:
    rng = np.random.default_rng(0 if chain else 1)
    proposals, all_logits, expected = [], [], []
    for _ in range(300):
        n = int(rng.integers(0, 9))
        parents = random_tree(rng, n, chain)
        root = torch.tensor([rng.integers(V), rng.integers(V)])
        greedy = [root.tolist()]  # the target's greedy continuation, as states
        for _ in range(n + 1):
            a, b = greedy[-1]
            greedy.append([b, int(TARGET.logits(torch.tensor([a, b])).argmax())])
        continuation = [s[1] for s in greedy[1:]]
        tokens: list[int] = []
        for i, p in enumerate(parents):  # mostly the greedy token, siblings distinct
            depth = len(root_paths(parents)[i]) - 1
            taken = {tokens[j] for j in range(i) if parents[j] == p}
            choices = [t for t in range(V) if t not in taken]
            want = continuation[depth]
            tokens.append(want if want in choices and rng.random() < 0.7 else int(rng.choice(choices)))
        proposal = Proposal(token_ids=tokens, parents=parents)
        rows = target_rows(parents, torch.tensor([tokens], dtype=torch.long).view(1, n), root[None])[0]
        # Brute force: the deepest node whose root path spells the greedy continuation.
        best = max((len(path) for path in root_paths(parents)
                    if [tokens[j] for j in path] == continuation[:len(path)]), default=0)
        proposals.append(proposal)
        all_logits.append(rows)
        expected.append(continuation[:best + 1])
    results = verify_batch(all_logits, proposals)
    for proposal, result, want in zip(proposals, results, expected):
        assert result.tokens(proposal) == want
        paths = root_paths(proposal.parents)
        assert result.accepted == (paths[result.accepted[-1]] if result.accepted else [])
    # One padded tensor gives the same answers as the list, and one-at-a-time verification too.
    padded = torch.nn.utils.rnn.pad_sequence(all_logits, batch_first=True)
    assert verify_batch(padded, proposals) == results
    assert [verify(lg, p) for lg, p in zip(all_logits[:40], proposals[:40])] == results[:40]


def test_greedy_ignores_draft_logits_and_sampling_params() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    tokens = logits.argmax(-1)[:3].tolist()
    proposal = Proposal.chain(tokens, draft_logits=torch.randn(3, V))
    result = verify(logits, proposal, temperature=0.0, top_k=2, top_p=0.5)
    assert result == VerifyResult([0, 1, 2], int(logits[3].argmax()))


# ------------------------------------------------------------------------------------------------------------- sampling

TRIALS = 8_000
# Trial t uses shape t % len(shapes): mixed lengths in one padded batch, and leaves at depth 1 and 2 so that the second
# emitted token is sometimes a bonus token.
SHAPES = {"chain": [[-1], [-1, 0], [-1, 0, 1]], "tree": [[-1, -1, 0, 0, 1, 3], [-1, -1, -1, 0, 0, 3]]}
SAMPLING = {"t1": (1.0, 0, 1.0), "t0.8-k4-p0.85": (0.8, 4, 0.85)}


def propose(parents: list[int], root: torch.Tensor, model_draft: bool, params: tuple[float, int, float],
            gen: torch.Generator) -> tuple[list[Proposal], torch.Tensor]:
    """One proposal per trial (root [T, 2]) and the target logits [T, 1 + n, V] over it. Model drafts: each child drawn
    i.i.d. from the processed draft distribution at its parent. Deterministic drafts: a node's children are the draft's
    1st, 2nd, ... most likely tokens."""
    trials, n = root.shape[0], len(parents)
    tokens = torch.empty(trials, n, dtype=torch.long)
    draft_logits = torch.empty(trials, n, V)
    states = torch.empty(trials, n, 2, dtype=torch.long)
    for i, p in enumerate(parents):
        parent_state = root if p < 0 else states[:, p]
        draft_logits[:, i] = DRAFT.logits(parent_state)
        if model_draft:
            tokens[:, i] = torch.multinomial(process_logits(draft_logits[:, i], *params), 1, generator=gen)[:, 0]
        else:
            rank = sum(1 for j in range(i) if parents[j] == p)
            tokens[:, i] = draft_logits[:, i].argsort(dim=-1, descending=True, stable=True)[:, rank]
        states[:, i, 0], states[:, i, 1] = parent_state[:, 1], tokens[:, i]
    proposals = [Proposal(token_ids=t, parents=list(parents), draft_logits=dl if model_draft else None)
                 for t, dl in zip(tokens.tolist(), draft_logits)]
    return proposals, target_rows(parents, tokens, root)


def speculate_step(shapes: list[list[int]], root: torch.Tensor, model_draft: bool, params: tuple[float, int, float],
                   gen: torch.Generator) -> tuple[list[VerifyResult], list[Proposal]]:
    """One propose + verify step for every trial (root [T, 2]), all trials in one verify_batch call."""
    proposals: list[Proposal | None] = [None] * root.shape[0]
    logits: list[torch.Tensor | None] = [None] * root.shape[0]
    for s, parents in enumerate(shapes):
        trials = range(s, root.shape[0], len(shapes))
        ps, rows = propose(parents, root[s::len(shapes)], model_draft, params, gen)
        for t, p, r in zip(trials, ps, rows):
            proposals[t], logits[t] = p, r
    return verify_batch(logits, proposals, *params, generator=gen), proposals


def run_two_tokens(shapes: list[list[int]], model_draft: bool, params: tuple[float, int, float], seed: int
                   ) -> tuple[np.ndarray, list[VerifyResult], list[Proposal]]:
    """The first two emitted tokens of TRIALS generations from ROOT, speculating every step ([TRIALS, 2]), with the
    first step's results and proposals."""
    gen = torch.Generator().manual_seed(seed)
    results, proposals = speculate_step(shapes, torch.tensor(ROOT).expand(TRIALS, 2), model_draft, params, gen)
    emitted = [r.tokens(p) for r, p in zip(results, proposals)]
    out = np.array([[e[0], e[1] if len(e) > 1 else -1] for e in emitted])
    again = np.flatnonzero(out[:, 1] < 0)  # one token emitted: the next step proposes from (ROOT[1], t1)
    if len(again):
        root2 = torch.stack([torch.full((len(again),), ROOT[1]), torch.from_numpy(out[again, 0])], dim=1)
        results2, proposals2 = speculate_step(shapes, root2, model_draft, params, gen)
        out[again, 1] = [r.tokens(p)[0] for r, p in zip(results2, proposals2)]
    return out, results, proposals


def target_joint(params: tuple[float, int, float]) -> np.ndarray:
    """P(t1, t2) of the target alone from the processed trigram distributions (float64, independent of the verifier)."""
    first = brute_process(TARGET.logits(torch.tensor(ROOT)).numpy(), *params)
    second = np.stack([brute_process(TARGET.logits(torch.tensor([ROOT[1], t])).numpy(), *params) for t in range(V)])
    return first[:, None] * second


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("model_draft", [True, False], ids=["model_q", "deterministic"])
@pytest.mark.parametrize("shape", SHAPES)
def test_sampling_preserves_target_distribution(shape: str, model_draft: bool, sampling: str) -> None:
    params = SAMPLING[sampling]
    seed = 1000 * list(SHAPES).index(shape) + 10 * model_draft + list(SAMPLING).index(sampling)
    out, results, proposals = run_two_tokens(SHAPES[shape], model_draft, params, seed)
    joint = target_joint(params)
    counts = np.zeros((V, V))
    np.add.at(counts, (out[:, 0], out[:, 1]), 1)
    # Nothing outside the target's support (top-k / top-p) is ever emitted.
    assert counts[joint == 0].sum() == 0
    assert chi_square_p_value(counts.sum(1), joint.sum(1)) > 1e-4  # first token
    assert chi_square_p_value(counts.ravel(), joint.ravel()) > 1e-4  # first two tokens
    # Every branch of the rule was exercised: rejection at the root, a leaf reached (bonus token) and, in trees, a
    # sibling accepted after the first child was rejected.
    reached_leaf = [bool(r.accepted) and r.accepted[-1] not in p.parents for r, p in zip(results, proposals)]
    assert 0.05 < np.mean([not r.accepted for r in results]) < 0.95
    assert np.mean(reached_leaf) > 0.02
    if shape == "tree":
        assert np.mean([r.accepted[:1] == [1] for r in results]) > 0.02


def test_sibling_tests_use_the_normalised_residual() -> None:
    """Deterministic siblings a, b with p = (0.5, 0.4, 0.1): after a is rejected the residual is (0, 0.4, 0.1) / 0.5,
    so b is accepted with probability 0.8 (not 0.4); after b is rejected too only token 2 is left."""
    target = torch.tensor([[[0.5, 0.4, 0.1], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    tokens, parents, num_nodes = torch.tensor([[0, 1]]), torch.tensor([[-1, -1]]), torch.tensor([2])
    walk = reference.rejection_walk(target, None, tokens, parents, num_nodes, torch.tensor([[0.9, 0.7]]))
    assert walk[0].tolist() == [[1, -1]] and walk[2].tolist() == [2] and walk[3].tolist() == [0]
    walk = reference.rejection_walk(target, None, tokens, parents, num_nodes, torch.tensor([[0.9, 0.85]]))
    assert walk[1].tolist() == [0] and walk[3].tolist() == [1]
    torch.testing.assert_close(walk[4], torch.tensor([[0.0, 0.0, 0.1]]))
    assert reference.race_sample(target, walk[2], walk[3], walk[4], torch.rand(1, 3) + 0.1).tolist() == [2]


def test_sampling_is_reproducible_with_a_generator() -> None:
    proposal = Proposal.chain([1, 2, 3], draft_logits=torch.randn(3, V, generator=torch.Generator().manual_seed(5)))
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    runs = [[verify(logits, proposal, 1.0, generator=g) for _ in range(20)]
            for g in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))]
    assert runs[0] == runs[1]
    assert len({(tuple(r.accepted), r.next_token) for r in runs[0]}) > 1


def test_one_hot_draft_rows_equal_deterministic_draft() -> None:
    """A mixed batch gives deterministic proposals one-hot q rows: the rules must treat them exactly as q = None."""
    gen = torch.Generator().manual_seed(11)
    batch, n = 64, 5
    parents = torch.tensor([[-1, -1, 0, 0, 2]] * batch, dtype=torch.int32)
    tokens = torch.randint(0, V, (batch, n), generator=gen, dtype=torch.int32)
    target = process_logits(torch.randn(batch, n + 1, V, generator=gen), 1.0)
    one_hot = torch.nn.functional.one_hot(tokens.long(), V).float()
    uniforms = torch.rand(batch, n, generator=gen)
    num_nodes = torch.full((batch,), n, dtype=torch.int32)
    a = reference.rejection_walk(target, None, tokens, parents, num_nodes, uniforms)
    b = reference.rejection_walk(target, one_hot, tokens, parents, num_nodes, uniforms)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert a[1].float().mean() > 0 and (a[1] < n).any()


def test_residual_fallback_when_draft_equals_target() -> None:
    """q == p: the residual is all zeros, so a (rare, rounding-only) rejection must fall back to p."""
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.5, 0.25, 0.25, 0.0]])
    target = p[None]
    draft = p[None, :1]
    # u just below 1: u * q(x) < p(x) holds for q == p > 0, so token 1 is accepted...
    accepted = reference.rejection_walk(target, draft, torch.tensor([[1]]), torch.tensor([[-1]]), torch.tensor([1]),
                                        torch.tensor([[0.999]]))
    assert accepted[1].tolist() == [1] and accepted[3].tolist() == [0]
    # ...and when q(x) > p(x) only by rounding, a rejection leaves a zero residual: sample from p itself.
    draft = torch.tensor([[[0.5, 0.25, 0.25 + 1e-7, 0.0]]])
    rejected = reference.rejection_walk(target, draft, torch.tensor([[2]]), torch.tensor([[-1]]), torch.tensor([1]),
                                        torch.tensor([[0.9999999]]))
    assert rejected[1].tolist() == [0] and rejected[3].tolist() == [0] and rejected[2].tolist() == [0]


# ------------------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"backend": "cuda"}, "backend"),
])
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        verify(torch.zeros(2, V), Proposal.chain([1]), **kwargs)


@pytest.mark.parametrize("logits,proposal,match", [
    (torch.zeros(3, V), Proposal.chain([1]), r"\[2, V\]"),  # rows != 1 + n
    (torch.zeros(2, V, 1), Proposal.chain([1]), "1 \\+ len"),
    (torch.zeros(2, 0), Proposal.chain([0]), "empty vocabulary|outside"),
    (torch.zeros(3, V), Proposal(token_ids=[1, 2], parents=[-1, 1]), "precede"),
    (torch.zeros(3, V), Proposal(token_ids=[1, 2], parents=[0, -1]), "precede"),
    (torch.zeros(3, V), Proposal(token_ids=[1, 2], parents=[-1]), "parents"),
    (torch.zeros(2, V), Proposal.chain([V]), "vocabulary"),
    (torch.zeros(2, V), Proposal.chain([-1]), "vocabulary"),
    (torch.zeros(2, V), Proposal.chain([1], draft_logits=torch.zeros(2, V)), "draft_logits"),
    (torch.zeros(2, V), Proposal.chain([1], draft_logits=torch.zeros(1, V + 1)), "draft_logits"),
])
def test_bad_input(logits: torch.Tensor, proposal: Proposal, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        verify(logits, proposal, temperature=1.0)


def test_bad_batch_input() -> None:
    with pytest.raises(ValueError, match="2 sequences but 1 proposals"):
        verify_batch([torch.zeros(2, V), torch.zeros(2, V)], [Proposal.chain([1])])
    with pytest.raises(ValueError, match="one vocabulary size"):
        verify_batch([torch.zeros(2, V), torch.zeros(2, V + 1)], [Proposal.chain([1])] * 2)
    with pytest.raises(ValueError, match="longest proposal"):
        verify_batch(torch.zeros(2, 2, V), [Proposal.chain([1, 2]), Proposal.chain([1])])
    with pytest.raises(ValueError, match="empty vocabulary"):
        process_logits(torch.zeros(3, 0), 1.0)
    assert verify_batch([], []) == []
