"""Drive any proposer through the contract in `hybridspec.proposal` and check what it promises.

No torch here, so the ArcticInference adapter's environment (.venv-peers) runs it too. Raises AssertionError on the
first broken promise.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

from hybridspec.proposal import FeatureProposer, Proposal, Proposer, check_proposer

FeaturesFor = Callable[[int], Any]  # n -> the target's features for n positions (a FeatureProposer's input)


def check_proposal(proposal: Proposal, budget: int, *, tree: bool, vocab_size: int) -> None:
    """The Proposal invariants: a well-formed tree over the vocabulary (`Proposal.check`: parents precede children),
    at most `budget` nodes, probabilities in [0, 1], a chain unless a tree was asked for."""
    try:
        proposal.check(vocab_size)
    except ValueError as e:
        raise AssertionError(f"{e}: {proposal}") from None
    n = len(proposal)
    assert n <= budget, f"{n} tokens proposed for a budget of {budget}"
    if proposal.probs is not None:
        assert len(proposal.probs) == n, f"{len(proposal.probs)} probabilities for {n} tokens"
        assert all(-1e-6 <= p <= 1 + 1e-6 for p in proposal.probs), f"probabilities outside [0, 1]: {proposal.probs}"
    assert tree or proposal.is_chain, f"a chain was asked for, got parents {proposal.parents}"


def _raises(exc: type[BaseException], fn: Callable, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except exc:
        return
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} did not raise {exc.__name__}")


def exercise_proposer(proposer: Proposer | FeatureProposer, prompt: Sequence[int], continuation: Sequence[int], *,
                      vocab_size: int, features_for: FeaturesFor | None = None,
                      budgets: Sequence[int] = (1, 3, 8)) -> int:
    """start -> (speculate -> append)* -> finish of one request, a second request that extends it and is aborted,
    the error rules for request ids, and a request whose prompt features come late where a FeatureProposer takes
    them so (`late_prompt_features`). Each step appends the next 1-3 tokens of `continuation` (what a verifier
    would commit). Returns how many proposals were non-empty, so callers can check that the proposer drafted at all.
    features_for(n) gives the target's features for n positions; required for a FeatureProposer."""
    check_proposer(proposer)
    wants = proposer.wants_target_features
    assert isinstance(wants, bool) and isinstance(proposer.drafts_trees, bool) and \
        isinstance(proposer.prefers_trees, bool), "the contract's flags are bools"
    assert isinstance(proposer.num_speculative_tokens, int) and proposer.num_speculative_tokens >= 0
    assert not wants or features_for is not None, "a FeatureProposer needs features_for"

    def start(rid: Hashable, tokens: Sequence[int], extends: Hashable | None = None) -> None:
        if wants:
            proposer.start_request(rid, list(tokens), features=features_for(len(tokens) - 1), extends=extends)
        else:
            proposer.start_request(rid, list(tokens), extends=extends)

    def append(rid: Hashable, tokens: Sequence[int]) -> None:
        if wants:
            proposer.append(rid, list(tokens), features=features_for(len(tokens)))
        else:
            proposer.append(rid, list(tokens))

    if wants:
        proposer.set_sampling(None, None)
    drafted, history = 0, list(prompt)
    start("contract-a", history)
    _raises(ValueError, start, "contract-a", history)  # already running
    pos, step = 0, 0
    while pos < len(continuation):
        for budget in budgets:
            for tree in ((False, True) if proposer.drafts_trees else (False,)):
                proposal = proposer.speculate("contract-a", budget, tree=tree)
                check_proposal(proposal, budget, tree=tree, vocab_size=vocab_size)
                drafted += len(proposal) > 0
        default = proposer.speculate("contract-a")
        check_proposal(default, proposer.num_speculative_tokens, tree=False, vocab_size=vocab_size)
        assert len(proposer.speculate("contract-a", 0)) == 0, "a budget of 0 gives an empty proposal"
        take = 1 + step % 3
        append("contract-a", continuation[pos:pos + take])
        history += continuation[pos:pos + take]
        pos, step = pos + take, step + 1
    proposer.finish_request("contract-a")
    _raises(KeyError, proposer.speculate, "contract-a", 4)  # ended
    _raises(KeyError, append, "contract-a", continuation[:1])

    # an agent's next turn: the whole conversation again, plus a new message; then cancelled
    start("contract-b", history + list(prompt[:5]), extends="contract-a")
    proposal = proposer.speculate("contract-b", 4)
    check_proposal(proposal, 4, tree=False, vocab_size=vocab_size)
    append("contract-b", continuation[:2])
    proposer.abort_request("contract-b")
    _raises(KeyError, proposer.speculate, "contract-b", 4)
    _raises(KeyError, proposer.speculate, "never-started", 4)
    _raises(KeyError, proposer.finish_request, "never-started")

    if wants and getattr(proposer, "late_prompt_features", False):
        # the prompt's features after start_request (the engine runs a prompt with its first step): drafts meanwhile
        # need none, an append must wait for them, and they come once
        proposer.start_request("contract-c", list(prompt), features=None)
        check_proposal(proposer.speculate("contract-c", 4), 4, tree=False, vocab_size=vocab_size)
        _raises(ValueError, append, "contract-c", continuation[:1])
        proposer.prompt_features("contract-c", features_for(len(prompt) - 1))
        _raises(ValueError, proposer.prompt_features, "contract-c", features_for(len(prompt) - 1))
        append("contract-c", continuation[:2])
        check_proposal(proposer.speculate("contract-c", 4), 4, tree=False, vocab_size=vocab_size)
        proposer.abort_request("contract-c")
    return drafted
