"""The accounting of benchmarks/bench_vllm_peagle.py: our side's per-step record agrees with the engine's counters,
and vLLM's steps, clipped at max tokens, are the steps our engine takes for the same acceptances."""
from __future__ import annotations

import random

import pytest

from bench_vllm_peagle import Acceptance, RecordingRouter, run_ours, vllm_within_budget
from hybridspec.runtime.engine import Engine
from hybridspec.model.target import TargetModel
from hybridspec.tools.testing import tiny_llama, tiny_tokenizer
from test_engine_drafters import VOCAB, make_drafter

K = 4


def test_our_record_matches_the_engine_counters():
    model = tiny_llama(vocab_size=VOCAB, seed=7, init_std=0.3)
    engine = Engine(TargetModel(model), tiny_tokenizer(VOCAB), router=RecordingRouter(K),
                    drafters={"peagle": make_drafter("peagle", model)})
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(4)]
    ours = run_ours(engine, prompts, max_new_tokens=24, k=K)
    stats, per_request = ours["stats"], ours["per_request"]
    # one record entry per verification step of the speculative runs, none from the plain runs between them
    assert sum(len(a.accepted) for a in per_request) == stats.steps
    assert sum(ours["total"].drafted) == stats.draft_tokens > 0
    assert sum(ours["total"].accepted) == stats.accepted_tokens > 0
    assert ours["spec"] == ours["plain"]
    positions = ours["total"].accepted_per_position()
    assert sum(positions) == stats.accepted_tokens and positions == sorted(positions, reverse=True)


@pytest.mark.parametrize("seed", range(20))
def test_vllm_steps_clipped_at_max_tokens_are_our_engines_steps(seed):
    """For the same acceptance lengths per step (how many draft tokens the target agrees with), vLLM drafts K every
    step and its prefill gives the first token; our engine drafts at most the tokens still wanted minus the bonus."""
    rng = random.Random(seed)
    max_tokens = rng.randint(2, 40)
    agree = [rng.randint(0, K) for _ in range(max_tokens)]
    vllm, generated = Acceptance(K), 1
    for a in agree:
        if generated >= max_tokens:
            break
        vllm.add_step(K, a)
        generated += a + 1
    ours, generated = Acceptance(K), 1
    for a in agree:
        if generated >= max_tokens:
            break
        budget = min(K, max_tokens - generated - 1)
        ours.add_step(budget, min(a, budget))
        generated += min(a, budget) + 1
    clipped = vllm_within_budget(vllm, max_tokens)
    assert (clipped.drafted, clipped.accepted) == (ours.drafted, ours.accepted)
    assert 1 + sum(a + 1 for a in clipped.accepted) == max_tokens


def test_a_step_cannot_accept_more_than_it_drafted():
    with pytest.raises(ValueError, match="2 drafted and 3 accepted"):
        Acceptance(K).add_step(2, 3)
