"""The verify-cost model shared by the router, the engine and trace replay, and the cost gate (the default router)."""
import json

import numpy as np

import pytest

from hybridspec.proposal import Proposal
from hybridspec.router import DEFAULT_VERIFY_MS, CostGate, VerifyCost, positional_chain, verify_costs_by_context


def test_interpolates_and_extrapolates():
    cost = VerifyCost({0: 59.0, 16: 111.0, 32: 149.0})
    assert cost(0) == 59.0 and cost(16) == 111.0
    assert cost(24) == pytest.approx((111.0 + 149.0) / 2)
    assert cost(40) == pytest.approx(149.0 + 8 * (149.0 - 111.0) / 16)
    assert cost.relative(16) == pytest.approx(111.0 / 59.0)
    assert VerifyCost().table() == DEFAULT_VERIFY_MS


def test_loads_tables_and_measurements(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"0": 10, "8": 12}))
    assert VerifyCost.load(tmp_path / "t.json")(4) == pytest.approx(11.0)
    measured = {"verify_cost": {"draft_tokens": [0, 2, 4], "ms": [20.0, 30.0, 32.0], "relative": [1, 1.5, 1.6]}}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    assert VerifyCost.load(tmp_path / "m.json")(3) == pytest.approx(31.0)
    assert VerifyCost.load({0: 1.0, 2: 3.0})(1) == pytest.approx(2.0)
    assert VerifyCost.load(None).table() == DEFAULT_VERIFY_MS


def test_bad_tables_are_rejected(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"4": 10}))
    with pytest.raises(ValueError, match="bad.json.*k = 0"):
        VerifyCost.load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        VerifyCost.load(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="> 0"):
        VerifyCost({0: 10.0, 4: -1.0})


def test_cost_gate_trims_to_the_best_expected_gain():
    gate = CostGate({0: 1.0, 1: 1.5, 2: 1.55, 4: 1.8, 8: 2.0})  # one table for every context
    assert gate.cost(3) == pytest.approx(1.675) and gate.cost(16) == pytest.approx(2.4)
    confident = Proposal.chain([1, 2, 3, 4], probs=[1.0, 1.0, 1.0, 1.0])
    assert gate.trim(confident) is confident
    # expected tokens per cost: m=1: 1.3/1.5, m=2: 1.4/1.55, m=3: 1.45/1.675: no prefix beats a plain step
    assert len(gate.trim(Proposal.chain([1, 2, 3], probs=[0.3, 0.1, 0.05]))) == 0
    # m=2 gives (1 + 0.9 + 0.8) / 1.55 = 1.74, better than keeping the unlikely tail (m=3: 2.75 / 1.675 = 1.64)
    trimmed = gate.trim(Proposal.chain([7, 8, 9, 10], probs=[0.9, 0.8, 0.05, 0.01]))
    assert trimmed.token_ids == [7, 8] and trimmed.parents == [-1, 0]
    tree = Proposal(token_ids=[1, 2, 3, 4, 5], parents=[-1, -1, 0, 2, 1], probs=[0.9, 0.05, 0.85, 0.8, 0.04],
                    score=2.64, source="suffix")
    kept = gate.trim(tree)
    assert kept.token_ids == [1, 3, 4] and kept.parents == [-1, 0, 1]


def test_gate_calibrates_overconfident_proposers_online():
    gate = CostGate({0: 1.0, 8: 1.2})
    draft = Proposal.chain([1, 2, 3, 4], probs=[0.55, 0.5, 0.5, 0.5], source="suffix")
    assert len(gate.trim(draft)) == 4  # taken at its word: 1 + 2.05 tokens for 1.1 steps
    for _ in range(30):  # but such nodes are never accepted
        gate.observe([draft], [[]])
    assert gate.accept_probability("suffix", 0.5) < 0.1
    assert len(gate.trim(draft)) == 0
    other = Proposal.chain([1, 2, 3, 4], probs=[0.55, 0.5, 0.5, 0.5], source="ngram")
    assert len(gate.trim(other)) == 4  # calibration is per source
    for _ in range(30):  # accepted after all: the estimate recovers
        gate.observe([draft], [[0, 1, 2, 3]])
    assert gate.accept_probability("suffix", 0.5) > 0.5 and len(gate.trim(draft)) == 4
    assert CostGate(calibrate=False).accept_probability("suffix", 0.5) == 0.5


def test_a_chain_rated_by_position_learns_each_positions_acceptance_and_keeps_the_prefix_that_pays():
    """vLLM's EAGLE drafts carry no probabilities: rated by position, the gate learns that later positions are
    accepted less (here: the first 80%, the second 40%, the rest never) and keeps the paying prefix."""
    gate = CostGate({0: 1.0, 1: 1.1, 2: 1.2, 4: 1.4, 8: 1.8})
    draft = positional_chain([5] * 7, "peagle")
    assert draft.probs == pytest.approx([0.95, 0.85, 0.75, 0.65, 0.55, 0.45, 0.35])
    assert len(gate.trim(draft)) == 7  # its prior: every position pays
    rng = np.random.default_rng(0)
    for _ in range(400):
        first, second = rng.random() < 0.8, rng.random() < 0.5
        gate.observe([draft], [[0, 1] if first and second else [0] if first else []])
    learnt = gate.calibrated_path_probs(draft)
    assert learnt[0] == pytest.approx(0.8, abs=0.08) and learnt[1] == pytest.approx(0.4, abs=0.08)
    assert max(learnt[2:]) < 0.05
    assert gate.trim(draft).token_ids == [5, 5]  # (1 + 0.8 + 0.4) / 1.2 beats 1.8 / 1.1 and any longer prefix
    assert gate.expected_tokens(draft) == pytest.approx(1.2, abs=0.2)


def test_cost_grows_with_context():
    gate = CostGate({512: {0: 10.0, 16: 12.0}, 4096: {0: 10.0, 16: 40.0}})  # {context: {k: ms}}
    assert gate.cost(16, 512) == pytest.approx(1.2) and gate.cost(16, 4096) == pytest.approx(4.0)
    assert gate.cost(16, 2304) == pytest.approx(2.6) and gate.cost(8, 100) == pytest.approx(1.1)
    assert gate.cost(0, 9999) == 1.0
    # the same draft is worth verifying at a short context (1.15 / 1.0125) and not at a long one (1.15 / 1.1875)
    draft = Proposal.chain(list(range(16)), probs=[0.15] + [0.01] * 15)
    assert len(gate.trim(draft, 512)) == 1 and len(gate.trim(draft, 4096)) == 0


def test_verify_cost_tables_by_context(tmp_path):
    measured = {"draft_tokens": [0, 1, 8], "ms": [50.0, 80.0, 100.0], "context": 512}
    several = dict(measured, by_context=[measured, dict(measured, context=2048, ms=[100.0, 150.0, 300.0])])
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(several))  # what `python benchmarks/bench_verify_cost.py` writes
    costs = verify_costs_by_context(path)
    assert sorted(costs) == [512, 2048] and costs[2048].relative(8) == pytest.approx(3.0)
    assert list(verify_costs_by_context(measured)) == [0]  # one table: for every context
    assert verify_costs_by_context({0: 2.0, 4: 3.0})[0].relative(4) == pytest.approx(1.5)
    assert CostGate(path).cost(8, 1280) == pytest.approx(2.5)  # halfway between 2.0 at 512 and 3.0 at 2048
    assert sorted(verify_costs_by_context(None)) == [512, 2048, 4096]
    with pytest.raises(ValueError, match="k = 0"):
        verify_costs_by_context({1: 2.0})


# ---------------------------------------------------------------------------------------------------------------
# the step planned as a whole


def linear_gate(per_token_ms: float = 5.0, base_ms: float = 50.0, per_row_ms: float = 2.0, flat_tokens: int = 1):
    """A gate whose passes cost base + per_token per token past `flat_tokens` (and per_row per further row), at
    every context alike."""
    tokens = {n: base_ms + per_token_ms * max(0, n - flat_tokens) for n in (1, 2, 4, 8, 16, 64, 256)}
    table = {k: tokens[1] + per_token_ms * max(0, k + 1 - flat_tokens) for k in (0, 16, 32)}
    return CostGate({"by_context": [{"context": 512, "draft_tokens": list(table), "ms": list(table.values())}],
                     "pass": {"tokens": list(tokens), "tokens_ms": list(tokens.values()), "per_row_ms": per_row_ms}},
                    calibrate=False, min_gain=1.0)


def chain(probs):
    return Proposal.chain(list(range(len(probs))), probs=probs)


def throughput(gate: CostGate, kept: list[Proposal], contexts, other: int = 0) -> float:
    expected = sum(1 + sum(p.probs or []) for p in kept)
    return expected / gate.pass_cost([1 + len(p) for p in kept], contexts, other)


def test_a_step_plan_is_the_best_split_of_draft_tokens_over_its_rows():
    import itertools

    gate = linear_gate()
    proposals = [chain([0.95, 0.9, 0.6, 0.2]), chain([0.7, 0.3]), chain([0.99, 0.98, 0.97])]
    contexts = [512] * 3
    planned = gate.plan(proposals, contexts).drafts(proposals)
    best = max(itertools.product(*(range(len(p) + 1) for p in proposals)),
               key=lambda ks: throughput(gate, [chain(p.probs[:k]) for p, k in zip(proposals, ks)], contexts))
    assert [len(p) for p in planned] == list(best)
    assert all(p.token_ids == q.token_ids[:len(p)] for p, q in zip(planned, proposals))


def test_under_load_drafts_shrink_and_vanish():
    gate = linear_gate(per_token_ms=5.0, base_ms=20.0, per_row_ms=5.0)
    draft = chain([0.9, 0.8, 0.5, 0.3])
    sizes = {rows: sum(map(len, gate.plan([draft] * rows, [512] * rows).drafts([draft] * rows))) / rows
             for rows in (1, 2, 8, 32)}
    assert sizes[1] >= sizes[2] >= sizes[8] >= sizes[32]
    assert sizes[1] > sizes[32]
    assert all(not keep for keep in gate.plan([chain([0.4, 0.2])] * 32, [512] * 32).keep)
    # a row's share of a loaded pass is the plain step a hybrid weighs its drafter against: the plan's load, a value
    assert gate.plan([draft], [512]).load is None
    load = gate.plan([draft] * 32, [512] * 32).load
    assert load.pass_tokens >= 32 and gate.step_ms(512, load) == load.row_ms < gate.step_ms(512)
    assert gate.rate(draft, 512, load) < gate.rate(draft, 512)
    # a hybrid's drafter (4 drafts for 10 ms) could pay where the suffix cache has no draft, alone and not in a pass
    # of 32 rows
    from hybridspec.router.hybrid import drafter_pays, perfect_rate

    alone = perfect_rate(gate, 4, 512)
    assert drafter_pays(1.0, alone, 10.0 / gate.step_ms(512))
    assert perfect_rate(gate, 4, 512, load) < alone
    assert not drafter_pays(1.0, perfect_rate(gate, 4, 512, load), 10.0 / gate.step_ms(512, load))
    assert perfect_rate(gate, 4, 512) == alone  # planning a step changed nothing of the gate's own


def test_the_vllm_hybrids_drafter_runs_in_a_step_only_where_its_drafts_pay_for_its_measured_pass():
    """drafter_step_pays: the step's plan with the drafter's drafts against the suffix drafts alone, priced by the
    gate's pass cost, the drafter's pass adding its measured share of the step."""
    from hybridspec.router.hybrid import drafter_step_pays

    gate = linear_gate(per_token_ms=5.0, base_ms=50.0)  # 4 verified tokens: 65 ms against a suffix-less 50
    drafted = [Proposal.chain([5, 6, 7], probs=[0.9, 0.8, 0.7], source="peagle")]  # 1 + 2.4 tokens
    no_suffix = [Proposal.chain([], source="suffix")]  # 1 token in 50 ms
    weak_suffix = [chain([0.9, 0.6, 0.4])]  # 1 + 1.9 tokens in 65 ms
    contexts = [512]
    # nothing to draft from the suffix cache: 3.4 / 65 against 1 / 50 pays unless the drafter costs 2.6x a step
    assert drafter_step_pays(gate, drafted, no_suffix, contexts, 0.1)
    assert drafter_step_pays(gate, drafted, no_suffix, contexts, 1.5)
    assert not drafter_step_pays(gate, drafted, no_suffix, contexts, 1.7)
    # a suffix draft nearly as good: 3.4 / 3.0 beats the drafter's share of 10%, not 20%
    assert drafter_step_pays(gate, drafted, weak_suffix, contexts, 0.1)
    assert not drafter_step_pays(gate, drafted, weak_suffix, contexts, 0.2)
    # not measured yet: it runs (and is measured); no rows: nothing to run for
    assert drafter_step_pays(gate, drafted, weak_suffix, contexts, None)
    assert not drafter_step_pays(gate, [None], [None], contexts, 0.1)
    # several rows share one pass: the drafter's row gains for all, a row without drafts costs both plans alike
    rows = drafted * 2 + [None]
    assert drafter_step_pays(gate, rows, weak_suffix * 2 + [None], contexts * 3, 0.1)


def test_beside_prompt_chunks_a_draft_pays_as_in_a_decode_step_and_one_row_alone_is_trimmed_as_ever():
    """The prompt chunks' seconds are not the rows' to share: counted in, any draft looked free beside them and
    every draft token delayed the prompts' first tokens (16 agents: median 10.4 s against 6.0 without drafts)."""
    gate = linear_gate(per_token_ms=20.0)
    weak, strong = chain([0.3, 0.2, 0.1]), chain([0.95, 0.9, 0.2])
    assert gate.plan([weak], [512]).drafts([weak]) == [gate.trim(weak, 512)] and len(gate.trim(weak, 512)) == 0
    assert len(gate.plan([weak], [512], other_tokens=256).keep[0]) == 0
    assert len(gate.plan([strong], [512], other_tokens=256).keep[0]) == 2
    rows = [weak, strong, chain([0.6, 0.5]), chain([0.99, 0.98, 0.97, 0.5])]
    alone = [len(k) for k in gate.plan(rows, [512] * 4).keep]
    assert [len(k) for k in gate.plan(rows, [512] * 4, other_tokens=256).keep] == alone  # a token costs the same
    assert sum(alone) > 0


def test_a_pass_cost_fit_learns_a_machines_costs_and_the_gate_plans_by_it():
    """Passes of a machine 3x slower than the prior whose draft tokens cost relatively twice the prior's: the fit
    learns its fixed, per-token and attention costs within 25% from 300 noisy passes (the scale from the first few;
    the per-row cost is nearly collinear with the tokens in these passes), leaves out a pass that waited
    (10x its prediction) and a pass of no rows, and a gate given its tables keeps fewer draft tokens than by the
    prior's, its pass cost the fit's prediction; a fit that saw nothing predicts the prior."""
    from hybridspec.router.measured import SCALE_PASSES, PassCostFit

    gate = CostGate()
    fit = PassCostFit(gate.pass_cost)
    assert fit.predict([1], [4096]) == pytest.approx(gate.pass_cost([1], [4096]), rel=0.1)
    true = fit.prior * np.array([3.0, 6.0, 3.0, 6.0])
    rng = np.random.default_rng(0)

    def random_pass():
        rows = int(rng.integers(1, 17))
        return [1 + int(rng.integers(0, 9)) for _ in range(rows)], [int(rng.integers(500, 8000)) for _ in range(rows)]

    learnt = 0
    for i in range(300):
        tokens, contexts = random_pass()
        ms = float(fit.features(tokens, contexts) @ true) * rng.uniform(0.9, 1.1)
        learnt += fit.observe(tokens, contexts, ms)
    assert learnt == fit.passes == 300 - SCALE_PASSES
    assert np.allclose(fit.costs()[[0, 1, 3]], true[[0, 1, 3]], rtol=0.25)
    tokens, contexts = random_pass()
    assert not fit.observe(tokens, contexts, 10 * fit.predict(tokens, contexts)) and fit.passes == 300 - SCALE_PASSES
    assert not fit.observe([], [], 5.0)
    assert fit.pass_cost()(tokens, contexts) == pytest.approx(fit.predict(tokens, contexts))  # the gate's pass: the fit

    draft = Proposal.chain(list(range(8)), probs=[0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], source="suffix")
    by_prior = len(gate.trim(draft, 4096))
    gate.set_costs(fit.verify_costs(), fit.pass_cost())
    assert 0 < len(gate.trim(draft, 4096)) < by_prior
    rows = [draft] * 8
    assert sum(map(len, gate.plan(rows, [4096] * 8).keep)) < sum(map(len, CostGate().plan(rows, [4096] * 8).keep))
