"""Oracle replay of agent traces through a proposer, and the cost model that turns it into a projected speedup.

For every call, in order: the proposer starts a request with the call's prompt (declaring the earlier call of the
same trajectory whose prompt + response this prompt extends, so a session-aware proposer indexes only new tokens),
then steps through the logged response: it proposes up to K tokens, the accepted length is the longest prefix of the
proposal equal to the response from the current position (a greedy target that generated the logged response
accepts exactly that), and the position advances by accepted + 1 (the target's own token after the accepted run),
the advance being appended to the proposer. The request is then finished, so its response enters the proposer's
global history, which persists across the trajectories of a framework as a server's would. Each framework gets a
fresh proposer: different agent frameworks are different deployments.

Projected speedup: without speculation every response token costs one target step, t_verify(0). With it, a step
that verifies k draft tokens costs t_verify(k) plus the proposer's measured speculate and append time; the table is
`hybridspec.router.VerifyCost` (SmolLM2-135M on this project's CPU by default, or the user's own).
"""
from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridspec.agent_traces.tokenization import TokenizedTrajectory
from hybridspec.proposal import Proposal, Proposer
from hybridspec.router import VerifyCost


@dataclass
class ReplayStats:
    """What one proposer did on a set of calls: per-step arrays and summed times."""

    calls: int = 0
    response_tokens: int = 0
    draft_tokens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))  # tokens proposed per step
    accepted: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))      # tokens accepted per step
    produced: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))      # tokens emitted per step
    speculate_ns: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # speculate() time per step
    append_ns: int = 0         # total append() time; one append per step
    finish_ns: int = 0         # total finish_request() time (the response joins the global history)
    start_ns: int = 0          # total start_request() time (prompt indexing; not part of the decode cost)
    wall_ns: int = 0           # total time of the replay loop for this proposer, start to finish of every call
    prompt_tokens: int = 0

    @property
    def steps(self) -> int:
        return len(self.produced)

    @classmethod
    def merge(cls, parts: Sequence["ReplayStats"]) -> "ReplayStats":
        return cls(
            calls=sum(p.calls for p in parts), response_tokens=sum(p.response_tokens for p in parts),
            draft_tokens=np.concatenate([p.draft_tokens for p in parts]),
            accepted=np.concatenate([p.accepted for p in parts]), produced=np.concatenate([p.produced for p in parts]),
            speculate_ns=np.concatenate([p.speculate_ns for p in parts]),
            append_ns=sum(p.append_ns for p in parts), finish_ns=sum(p.finish_ns for p in parts),
            start_ns=sum(p.start_ns for p in parts),
            wall_ns=sum(p.wall_ns for p in parts), prompt_tokens=sum(p.prompt_tokens for p in parts))

    def projected_speedup(self, cost: VerifyCost) -> float:
        if self.steps == 0:
            return 1.0
        baseline_ms = self.response_tokens * float(cost(0))
        spec_ms = float(cost(self.draft_tokens).sum()) + (int(self.speculate_ns.sum()) + self.append_ns) / 1e6
        return baseline_ms / spec_ms

    def summary(self, cost: VerifyCost) -> dict[str, float | int]:
        """The report's metrics (the JSON layout of `hybridspec replay`)."""
        proposed = int(self.draft_tokens.sum())
        us = self.speculate_ns / 1e3
        return {
            "calls": self.calls,
            "response_tokens": self.response_tokens,
            "steps": self.steps,
            "tokens_per_step": self.response_tokens / self.steps if self.steps else 0.0,
            "acceptance_rate": int(self.accepted.sum()) / proposed if proposed else 0.0,
            "us_per_speculate_p50": float(np.percentile(us, 50)) if self.steps else 0.0,
            "us_per_speculate_p99": float(np.percentile(us, 99)) if self.steps else 0.0,
            "us_per_append_token": self.append_ns / 1e3 / self.response_tokens if self.response_tokens else 0.0,
            "projected_speedup": self.projected_speedup(cost),
        }


@dataclass(frozen=True)
class ProposerSpec:
    """A named way to build a fresh proposer (one per framework), and whether it drafts trees."""

    label: str
    make: Callable[[], Proposer]
    tree: bool = False


PROPOSER_NAMES = ("suffix", "ngram", "arctic-suffix")


def proposer_spec(name: str, num_speculative_tokens: int, label: str | None = None, tree: bool = False,
                  **options) -> ProposerSpec:
    """`suffix` (hybridspec.suffix.SuffixCache), `ngram` (NgramProposer) or `arctic-suffix` (ArcticInference's suffix
    decoding through hybridspec.tools.peers.ArcticSuffixProposer; needs arctic-inference). `options` go to the
    constructor.
    tree=True drafts token trees of at most num_speculative_tokens nodes where the proposer drafts trees (n-gram
    drafts chains)."""
    if name == "suffix":
        from hybridspec.suffix import SuffixCache as cls
    elif name == "ngram":
        from hybridspec.suffix import NgramProposer as cls
    elif name == "arctic-suffix":
        from hybridspec.tools.peers import ArcticSuffixProposer as cls
    else:
        raise ValueError(f"unknown proposer {name!r}; known: {', '.join(PROPOSER_NAMES)}")
    # fail now, not mid-replay, on a bad option or a missing peer
    drafts_trees = cls(num_speculative_tokens=num_speculative_tokens, **options).drafts_trees
    return ProposerSpec(label or name, lambda: cls(num_speculative_tokens=num_speculative_tokens, **options),
                        tree and drafts_trees)


def arctic_available() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


def session_links(trajectory: TokenizedTrajectory) -> list[int | None]:
    """For each call, the latest earlier call of the trajectory whose prompt + response its prompt starts with."""
    links: list[int | None] = []
    for i, call in enumerate(trajectory.calls):
        link = None
        for j in range(i - 1, -1, -1):
            prev = trajectory.calls[j]
            lp, lr = len(prev.prompt), len(prev.response)
            if (len(call.prompt) >= lp + lr and np.array_equal(call.prompt[:lp], prev.prompt)
                    and np.array_equal(call.prompt[lp:lp + lr], prev.response)):
                link = j
                break
        links.append(link)
    return links


class Recorder:
    """One proposer's per-step lists over many `replay_call`s, turned into `ReplayStats` by `finish()`."""

    def __init__(self) -> None:
        self.draft_tokens: list[int] = []
        self.accepted: list[int] = []
        self.produced: list[int] = []
        self.speculate_ns: list[int] = []
        self.stats = ReplayStats()

    def finish(self) -> ReplayStats:
        s = self.stats
        s.draft_tokens = np.asarray(self.draft_tokens, dtype=np.int32)
        s.accepted = np.asarray(self.accepted, dtype=np.int32)
        s.produced = np.asarray(self.produced, dtype=np.int32)
        s.speculate_ns = np.asarray(self.speculate_ns, dtype=np.int64)
        return s


def accepted_length(draft: Proposal, target: Sequence[int]) -> int:
    """Greedy oracle: the longest path of the draft (a chain or a tree) that equals a prefix of `target`."""
    tokens, parents = draft.token_ids, draft.parents
    limit = min(len(tokens), len(target))
    if draft.is_chain:
        accepted = 0
        while accepted < limit and tokens[accepted] == target[accepted]:
            accepted += 1
        return accepted
    node, accepted = -1, 0
    while accepted < len(target):
        # parents precede children: the node's children come after it, among them at most one right token
        node = next((i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == target[accepted]),
                    None)
        if node is None:
            break
        accepted += 1
    return accepted


def replay_call(proposer: Proposer, rid: Hashable, prompt: np.ndarray, response: np.ndarray, extends: Hashable | None,
                num_speculative_tokens: int, rec: Recorder, tree: bool = False) -> None:
    """One call through the proposer, oracle-accepted against `response` step by step, recorded into `rec`."""
    clock = time.perf_counter_ns
    start = clock()
    proposer.start_request(rid, prompt, extends=extends)
    rec.stats.start_ns += clock() - start
    target = response.tolist()
    n, pos = len(target), 0
    while pos < n:
        t0 = clock()
        draft = proposer.speculate(rid, num_speculative_tokens, tree=tree)
        t1 = clock()
        accepted = accepted_length(draft, target[pos:pos + num_speculative_tokens])
        advance = min(accepted + 1, n - pos)
        t2 = clock()
        proposer.append(rid, response[pos:pos + advance])
        t3 = clock()
        pos += advance
        rec.draft_tokens.append(len(draft))
        rec.accepted.append(accepted)
        rec.produced.append(advance)
        rec.speculate_ns.append(t1 - t0)
        rec.stats.append_ns += t3 - t2
    t0 = clock()
    proposer.finish_request(rid)
    end = clock()
    rec.stats.finish_ns += end - t0
    rec.stats.wall_ns += end - start
    rec.stats.calls += 1
    rec.stats.response_tokens += n
    rec.stats.prompt_tokens += len(prompt)


def replay(trajectories: Sequence[TokenizedTrajectory], specs: Sequence[ProposerSpec], num_speculative_tokens: int,
           progress: bool | None = None) -> dict[str, dict[str, ReplayStats]]:
    """Replay every call through each proposer: `result[label][framework]`, frameworks in order of first appearance.

    Each framework gets fresh proposers. Calls run in order within each trajectory, trajectories in the given order,
    and the proposers take turns call by call, so that load from other processes falls on all of them alike.
    """
    from tqdm.auto import tqdm

    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"proposer labels must be unique, got {labels}")
    frameworks: dict[str, list[TokenizedTrajectory]] = {}
    for traj in trajectories:
        frameworks.setdefault(traj.framework, []).append(traj)
    out: dict[str, dict[str, ReplayStats]] = {label: {} for label in labels}
    with tqdm(total=sum(len(t.calls) for t in trajectories), unit="call", desc=f"replay {', '.join(labels)}",
              disable=None if progress is None else not progress) as bar:
        for framework, trajs in frameworks.items():
            proposers = [spec.make() for spec in specs]
            recorders = [Recorder() for _ in specs]
            next_rid = 0
            for traj in trajs:
                rids = []
                for call, link in zip(traj.calls, session_links(traj)):
                    rids.append(next_rid)
                    extends = None if link is None else rids[link]
                    for spec, proposer, rec in zip(specs, proposers, recorders):
                        replay_call(proposer, next_rid, call.prompt, call.response, extends, num_speculative_tokens,
                                    rec, spec.tree)
                    next_rid += 1
                    bar.update(1)
            for label, rec in zip(labels, recorders):
                out[label][framework] = rec.finish()
    return out
