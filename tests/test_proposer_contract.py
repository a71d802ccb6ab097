"""Every proposer that ships keeps the contract in hybridspec.proposal: start -> speculate -> append -> finish and
abort, the Proposal invariants (parents precede children, probabilities in [0, 1], length within the budget), the error
rules for request ids; and a proposer missing part of the contract fails with an error naming what it lacks."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from hybridspec.tools.conformance import exercise_proposer
from hybridspec.runtime.engine import DRAFTER_KINDS, Engine
from hybridspec.proposal import Proposal, check_proposer
from hybridspec.router import CostGate, HybridProposer
from hybridspec.speculators import DrafterProposer, TargetFeatures
from hybridspec.suffix import NgramProposer, SuffixCache
from hybridspec.model.target import TargetModel
from hybridspec.tools.testing import tiny_llama, tiny_tokenizer

from common import PEERS_PYTHON
from test_engine_drafters import VOCAB, make_drafter

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 4, 5, 6, 7, 8] * 4 + [3, 4]
CONTINUATION = [5, 6, 7, 8, 3, 4] * 3


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(vocab_size=VOCAB, seed=7, init_std=0.3)


def features_for(hidden_size: int):
    def make(n: int) -> TargetFeatures:
        return TargetFeatures(torch.randn(n, 3 * hidden_size), torch.randn(n, hidden_size))
    return make


def build(name: str, model):
    """(proposer, features_for or None) for a proposer name as `speculate=` spells it."""
    if name == "suffix":
        return SuffixCache(num_speculative_tokens=8, vocab_size=VOCAB), None
    if name == "ngram":
        return NgramProposer(num_speculative_tokens=8), None
    kind = name.split("+")[-1]
    drafter = DrafterProposer(make_drafter(kind, model))
    if name.startswith("suffix+"):
        drafter = HybridProposer(SuffixCache(vocab_size=VOCAB), drafter, CostGate(), num_speculative_tokens=8,
                                 draft_cost=kind)
    return drafter, features_for(model.config.hidden_size)


@pytest.mark.parametrize("name", ["suffix", "ngram", *DRAFTER_KINDS, *(f"suffix+{k}" for k in DRAFTER_KINDS)])
def test_every_proposer_keeps_the_contract(name, target_model):
    torch.manual_seed(0)
    proposer, features = build(name, target_model)
    drafted = exercise_proposer(proposer, PROMPT, CONTINUATION, vocab_size=VOCAB, features_for=features)
    assert drafted > 0, f"{name} never drafted on a repetitive prompt"


@pytest.mark.peers
def test_the_arctic_adapter_keeps_the_contract():
    """In .venv-peers (no torch there): the ArcticInference adapter through the same driver."""
    if not PEERS_PYTHON.exists():
        pytest.fail(f"{PEERS_PYTHON} not found: run scripts/setup_peers.sh (scripts/setup.sh does)")
    code = (f"from hybridspec.tools.conformance import exercise_proposer\n"
            f"from hybridspec.tools.peers import ArcticSuffixProposer\n"
            f"for prefers in (False, True):\n"
            f"    n = exercise_proposer(ArcticSuffixProposer(max_depth=16, num_speculative_tokens=8, "
            f"prefers_trees=prefers), {PROMPT}, {CONTINUATION}, vocab_size={VOCAB})\n"
            f"    assert n > 0\n"
            f"print('contract kept')\n")
    proc = subprocess.run([str(PEERS_PYTHON), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "contract kept" in proc.stdout, f"{proc.stdout}\n{proc.stderr}"


class Incomplete:
    """A proposer that forgot abort_request and the contract's flags."""

    num_speculative_tokens = 4

    def start_request(self, request_id, prompt, *, extends=None): ...

    def append(self, request_id, tokens): ...

    def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
        return Proposal.empty()

    def finish_request(self, request_id): ...


def test_a_proposer_missing_part_of_the_contract_is_named(target_model):
    with pytest.raises(TypeError, match=r"Incomplete is not a Proposer: it lacks drafts_trees, prefers_trees, "
                                        r"wants_target_features, abort_request"):
        check_proposer(Incomplete())
    engine = Engine(TargetModel(target_model), tiny_tokenizer(VOCAB))
    with pytest.raises(TypeError, match="abort_request"):
        engine.generate([3, 4, 5], max_new_tokens=4, speculate=Incomplete())

    class NoSampling(Incomplete):
        drafts_trees = prefers_trees = False
        wants_target_features = True

        def abort_request(self, request_id): ...

    with pytest.raises(TypeError, match="NoSampling is not a FeatureProposer: it lacks set_sampling"):
        check_proposer(NoSampling())


def test_a_broken_proposal_fails_the_driver():
    """The driver is not a rubber stamp: a proposer whose tree lists a child before its parent is caught."""
    class Backwards(NgramProposer):
        def speculate(self, request_id, num_speculative_tokens=None, *, tree=False):
            p = super().speculate(request_id, num_speculative_tokens, tree=tree)
            if len(p) >= 2:
                p.parents = [1, -1] + p.parents[2:]
            return p

    with pytest.raises(AssertionError, match="parents must precede their children"):
        exercise_proposer(Backwards(num_speculative_tokens=8), PROMPT, CONTINUATION, vocab_size=VOCAB)
