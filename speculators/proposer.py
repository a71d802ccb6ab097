"""`DrafterProposer`: a model drafter as a `hybridspec.proposal.FeatureProposer` (the target's features passed in)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from hybridspec.proposal import Proposal
from hybridspec.speculators.drafter import Drafter, ProbsFn, widen_chain
from hybridspec.speculators.features import TargetFeatures


@dataclass
class _Track:
    state: Any       # the drafter's state, None until the first features arrive
    length: int      # tokens of the sequence seen: features of positions 0..length-2 went in with tokens 1..length-1
    last_token: int  # the sequence's last token (a request extending this one must continue from it)
    pending: list[tuple[TargetFeatures, Sequence[int]]] = field(default_factory=list)  # not given to the drafter yet
    pending_slots: int = 0  # positions in `pending`
    awaiting: tuple[list[int], Hashable | None] | None = None  # (prompt, extends) until its features come

    def take_pending(self, drafter_context: int) -> tuple[TargetFeatures, list[int]] | None:
        """The pending positions (at most the last `drafter_context` of them) as one batch, and none left pending."""
        if not self.pending:
            return None
        features = TargetFeatures.cat([f for f, _ in self.pending])
        tokens = [int(t) for _, ts in self.pending for t in ts]
        self.pending, self.pending_slots = [], 0
        return features[-drafter_context:], tokens[-drafter_context:]


# positions a drafter reads at most: as many tokens per step as 1024 on agent calls (docs/history.md, "The window")
DEFAULT_DRAFTER_CONTEXT = 64


class DrafterProposer:
    """The engine's face of a model drafter: a `FeatureProposer` (the contract in `hybridspec.proposal`).

    start_request(rid, tokens, features=F): `tokens` is the whole prompt x_0..x_n; F holds the target's features at
    the positions before its last token, all of them (0..n-1) or the last len(F) only (the drafter's positions are
    relative: a shorter context drafts from less). With extends=rid0, a finished request whose tokens this prompt
    continues, and F starting where rid0's features ended (a session that reused its KV cache), rid0's drafter state
    is continued instead of rebuilt. append(rid, tokens, features=F): tokens = accepted draft tokens + the verifier's
    next token, F one row per token (the positions of the last committed token and the accepted drafts).
    speculate(rid, K) -> Proposal (chain). probs_fn None drafts greedily (temperature 0); for sampling, set it to the
    verifier's processing (e.g. functools.partial(process_logits, temperature=t, top_k=k, top_p=p)), so drafts come
    from the distribution the verifier assumes.

    Lazy: start_request and append only keep the features; the drafter runs when asked to draft, over every position
    it has not seen in one pass (its catch-up), so a step that drafts from elsewhere (a hybrid's suffix draft) costs
    it nothing. At most the last `drafter_context` positions are kept: a request that skipped more restarts the
    drafter from them (a drafter reads positions relative to its first one), and a prompt gives it at most its last
    `drafter_context`.
    `pending(rid)` is the catch-up the next draft will run.

    Late prompt features: start_request(rid, tokens, features=None) begins the request before the target has run the
    prompt (the engine runs it with the first step, `late_prompt_features`); it drafts nothing until
    prompt_features(rid, F) gives what start_request would have had.
    """

    wants_target_features = True
    late_prompt_features = True
    drafts_trees = True
    prefers_trees = True  # one more guess per depth buys more than the chain's tail

    def __init__(self, drafter: Drafter, num_speculative_tokens: int | None = None, probs_fn: ProbsFn | None = None,
                 generator: torch.Generator | None = None, max_retained: int = 8, tree_width: int = 3,
                 drafter_context: int = DEFAULT_DRAFTER_CONTEXT) -> None:
        if drafter_context < 1:
            raise ValueError(f"drafter_context must be >= 1, got {drafter_context}")
        self.drafter, self.probs_fn, self.generator = drafter, probs_fn, generator
        self.drafter_context = drafter_context
        self.num_speculative_tokens = num_speculative_tokens or drafter.num_speculative_tokens
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.tree_width = tree_width
        self.max_retained = max_retained
        self.live: dict[Hashable, _Track] = {}
        self.retained: dict[Hashable, _Track] = {}  # finished requests a later prompt may extend (oldest first)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.aux_layer_ids

    def set_sampling(self, probs_fn: ProbsFn | None, generator: torch.Generator | None) -> None:
        self.probs_fn, self.generator = probs_fn, generator

    @torch.inference_mode()
    def start_request(self, request_id: Hashable, tokens: Sequence[int], *, features: TargetFeatures | None,
                      extends: Hashable | None = None) -> None:
        if request_id in self.live:
            raise ValueError(f"request {request_id!r} is already running")
        if features is None:  # they come with prompt_features
            self.live[request_id] = _Track(None, len(tokens), int(tokens[-1]), awaiting=(list(tokens), extends))
            return
        if len(features) >= len(tokens):
            raise ValueError(f"{len(features)} feature rows for a prompt of {len(tokens)} tokens: pass one row per "
                             "position before the prompt's last token")
        first = len(tokens) - 1 - len(features)  # position of the first feature row
        previous = self.retained.pop(extends, None) if extends is not None else None
        if previous is not None and previous.length == first + 1 and tokens[first] == previous.last_token:
            track = previous
        else:
            track = _Track(None, first + 1, int(tokens[first]))
        self.live[request_id] = track
        if len(features):
            self._keep(track, features[-self.drafter_context:], list(tokens[first + 1:])[-self.drafter_context:])

    def prompt_features(self, request_id: Hashable, features: TargetFeatures) -> None:
        """The features a start_request(features=None) went without (see the class docstring)."""
        track = self._track(request_id)
        if track.awaiting is None:
            raise ValueError(f"request {request_id!r} already has its prompt's features")
        tokens, extends = track.awaiting
        del self.live[request_id]
        self.start_request(request_id, tokens, features=features, extends=extends)

    def _keep(self, track: _Track, features: TargetFeatures, tokens: Sequence[int]) -> None:
        track.pending.append((features, tokens))
        track.pending_slots += len(tokens)
        track.length += len(tokens)
        track.last_token = int(tokens[-1])
        if track.pending_slots > 2 * self.drafter_context:  # bound the memory of a request that never drafts
            features, tokens = track.take_pending(self.drafter_context)
            track.pending, track.pending_slots, track.state = [(features, tokens)], len(tokens), None

    def _catch_up(self, track: _Track) -> None:
        """Give the drafter the positions it has not seen; more than `drafter_context` of them restart it from the last
        `drafter_context`."""
        restart = track.state is None or track.pending_slots > self.drafter_context
        batch = track.take_pending(self.drafter_context)
        if batch is None:
            return
        features, tokens = batch
        if restart:
            track.state = self.drafter.begin(features, tokens)
        else:
            self.drafter.accept(track.state, features, tokens)

    def pending(self, request_id: Hashable) -> int:
        """Positions the request's next draft must first run through the drafter (at most `drafter_context`)."""
        return min(self._track(request_id).pending_slots, self.drafter_context)

    def context_length(self, request_id: Hashable) -> int:
        """Tokens of the request so far."""
        return self._track(request_id).length

    @torch.inference_mode()
    def append(self, request_id: Hashable, tokens: Sequence[int], *, features: TargetFeatures) -> None:
        track = self._track(request_id)
        if track.awaiting is not None:
            raise ValueError(f"request {request_id!r} is waiting for its prompt's features (prompt_features)")
        if len(tokens):
            self._keep(track, features, tokens)

    @torch.inference_mode()
    def speculate(self, request_id: Hashable, num_speculative_tokens: int | None = None, *,
                  tree: bool = False) -> Proposal:
        """A chain of num_speculative_tokens drafts; tree=True: a tree of at most that many nodes, the greedy chain
        with `tree_width - 1` siblings per depth (`widen_chain`), the chain no deeper than the drafter's K nor than
        num_speculative_tokens / tree_width (the depths a budget of that many nodes fills)."""
        return self.speculate_many([request_id], [num_speculative_tokens], tree=tree)[0]

    @torch.inference_mode()
    def speculate_many(self, request_ids: Sequence[Hashable], num_speculative_tokens: Sequence[int | None], *,
                       tree: bool = False, load: Any = None) -> list[Proposal]:
        """`speculate` for several requests, their catch-ups and drafts in one pass of the drafter (whatever the
        step's `load`: a drafter that is asked drafts)."""
        budgets = [self.num_speculative_tokens if k is None else k for k in num_speculative_tokens]
        drafting = []  # (index, state, chain length)
        for i, (request_id, k) in enumerate(zip(request_ids, budgets)):
            track = self._track(request_id)
            if k > 0:
                self._catch_up(track)
            if k > 0 and track.state is not None:  # else nothing to draft from yet: a one-token prompt
                drafting.append((i, track.state, min(-(-k // self.tree_width), self.num_speculative_tokens)
                                 if tree else k))
        proposals = [Proposal.empty(self.drafter.name) for _ in request_ids]
        if drafting:
            chains = self.drafter.propose_many([state for _, state, _ in drafting], [n for _, _, n in drafting],
                                               None if tree else self.probs_fn, self.generator)
            for (i, _, _), chain in zip(drafting, chains):
                proposals[i] = widen_chain(chain, self.tree_width, budgets[i]) if tree else chain
                proposals[i].drafter_ran = True
        return proposals

    def finish_request(self, request_id: Hashable) -> None:
        track = self._track(request_id)
        del self.live[request_id]
        if self.max_retained > 0:
            self.retained[request_id] = track
            while len(self.retained) > self.max_retained:
                del self.retained[next(iter(self.retained))]

    def abort_request(self, request_id: Hashable) -> None:
        self._track(request_id)
        del self.live[request_id]

    def _track(self, request_id: Hashable) -> _Track:
        track = self.live.get(request_id)
        if track is None:
            raise KeyError(f"unknown request {request_id!r}: not started, or already finished or aborted")
        return track
