"""Prefill: how a call's prompt gets into its KV cache.

A call begins with the longest prefix of each prompt the prefix cache holds (`cache_for_prompts`). A single prompt's
other tokens are left pending and run in the decode passes, `prefill_chunk` prompt tokens per step (`allot`): the
oldest prompt at least half of them, the rest to the shortest pending prompts first. The calls decoding meanwhile
wait a chunk's compute rather than the whole prompt's; a burst of cold prompts finishes one after another; an agent's
next call, its conversation mostly cached, gets its first token within a step or two instead of after every cold
prompt that arrived before it; and a prompt's last chunk goes with the call's first step (its weights read once for
both). Positions another running call has already computed for the same tokens are
copied from its cache rather than run again (in-flight prefix sharing). A batch of prompts runs whole at once.

A drafter reads the target's features at the prompt's last `drafter_context` positions: a pending prompt's passes
gather them and hand them to the proposer once the prompt has run (`late_prompt_features`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridspec.model.inputs import StepOutput
from hybridspec.model.target import TargetModel
from hybridspec.runtime.call import CallState
from hybridspec.runtime.prefix_cache import PrefixCache, cache_capacity, cache_for_prompts, common_prefix
from hybridspec.speculators import TargetFeatures

KV_HEADROOM_TOKENS = 64  # cache slots past prompt + max_new_tokens: the last step's draft fits without regrowth


@dataclass
class PromptChunk:
    """The pending prompt tokens a call runs in one step's pass. decodes: they are the last of them and the call's
    first step runs with them (False: a chunk alone, the first step waits for a later pass); features: how many of
    the chunk's last tokens' features the proposer reads."""

    tokens: list[int]
    decodes: bool = True
    features: int = 0


class Prefill:
    """The prompts of an engine's calls. defer: a single prompt runs in its decode steps' passes (False: in a pass of
    its own, at begin)."""

    def __init__(self, target: TargetModel, prefix_cache: PrefixCache | None, prefill_chunk: int,
                 drafter_context: int, defer: bool = True) -> None:
        self.target, self.prefix_cache = target, prefix_cache
        self.prefill_chunk, self.drafter_context, self.defer = prefill_chunk, drafter_context, defer

    def begin(self, call: CallState) -> list[TargetFeatures | None]:
        """Take a cache holding each prompt's longest cached prefix, then run the rest now or leave it pending.
        Returns the target's features at each prompt's last positions when the proposer reads them now (None: it
        gets them later, `hand_features`, or reads none)."""
        need = self.need(call)
        context = self.drafter_context if call.wants_target_features else 0
        call.cache, extends = cache_for_prompts(
            self.prefix_cache, self.target.new_cache, [s.tokens for s in call.seqs], need, self.target.max_seq_len,
            id(call.proposer) if call.proposer is not None else None, context)
        for seq, ext in zip(call.seqs, extends):
            seq.extends = ext
        todo = [seq.tokens[call.cache.lengths[row]:-1] for row, seq in enumerate(call.seqs)]  # the last: step input
        copies = self._same_prompts(call, todo)
        ran = [seq for row, seq in enumerate(call.seqs) if row not in dict(copies)]  # copies count as one prompt
        call.stats.sequences += len(ran)
        call.stats.prompt_tokens += sum(seq.prompt_len for seq in ran)
        call.stats.prefill_tokens += sum(len(t) for t in todo)
        late = not call.wants_target_features or getattr(call.proposer, "late_prompt_features", False)
        if len(todo) == 1 and todo[0] and late and self.defer:
            call.pending_prompt = todo[0]
            if call.wants_target_features:
                call.drafter_context = min(len(todo[0]), self.drafter_context)
            return [None]
        features: list[TargetFeatures | None] = [None] * len(call.seqs)
        with call.stats.timed("prefill_s"):
            if any(todo):
                out = self.target.prefill(call.cache, todo, drafter_context=context)
                if context:
                    features = [TargetFeatures(aux, final) for aux, final in out.drafter_features]
            elif context:  # every position is cached: the drafter goes on from the request this prompt extends
                features = [TargetFeatures(self._no_hidden(len(self.target.aux_layer_ids)), self._no_hidden(1))
                            for _ in call.seqs]
            for row, source in copies:  # a prompt the batch holds twice ran once: its KV is copied
                call.cache.copy_prefix(row, call.cache, source, call.cache.lengths[source],
                                       start=call.cache.lengths[row])
                features[row] = features[source]
        return features

    @staticmethod
    def _same_prompts(call: CallState, todo: list[list[int]]) -> list[tuple[int, int]]:
        """(row, source row) of the batch's rows whose prompt and cached prefix an earlier row has too (n samples of
        one prompt): their tokens to run are left out (`todo` emptied) and their KV copied from the source after."""
        first: dict[tuple, int] = {}
        copies = []
        for row, seq in enumerate(call.seqs):
            key = (call.cache.lengths[row], tuple(seq.tokens))
            if todo[row] and key in first:
                copies.append((row, first[key]))
                todo[row] = []
            first.setdefault(key, row)
        return copies

    def need(self, call: CallState) -> int:
        """The cache slots a call's rows need: the longest prompt, the new tokens and the last step's draft."""
        return min(max(len(s.tokens) for s in call.seqs) + call.options.max_new_tokens + KV_HEADROOM_TOKENS,
                   self.target.max_seq_len)

    def kv_bytes(self, call: CallState) -> int:
        """The KV the call's cache will hold (`cache_for_prompts`' capacity, every row), for admission."""
        capacity = cache_capacity(self.need(call), self.target.max_seq_len, self.prefix_cache is not None)
        return len(call.seqs) * (capacity * self.target.kv_bytes_per_token + self.target.state_bytes_per_row)

    def share(self, call: CallState, running: list[CallState]) -> bool:
        """Before a step's pass over the `running` calls (oldest first): copy into `call`'s cache what they have
        computed of its pending prompt. Returns whether `call` runs in this pass (False: a call begun earlier runs,
        in this very pass, the position `call` would run next; it waits a step and copies it after)."""
        return call.pending_prompt is None or not self._share(call, running)

    def allot(self, calls: list[CallState]) -> list[int]:
        """Each call's share of a step's `prefill_chunk` prompt tokens (0 for a call with no pending prompt): the oldest
        pending prompt takes up to half first, so that none waits for ever; the shortest pending prompts then take
        what they need (an agent's next call is a few hundred uncached tokens behind thousands of cached ones: it
        starts decoding at once rather than after every cold prompt ahead of it; shortest first also minimises the
        mean wait); whatever is left goes back to the oldest. `calls` are in the order they began, oldest first."""
        pending = [i for i, c in enumerate(calls) if c.pending_prompt is not None]
        shares = [0] * len(calls)
        if not pending:
            return shares
        oldest, left = pending[0], self.prefill_chunk
        shares[oldest] = min(len(calls[oldest].pending_prompt), left if len(pending) == 1 else left // 2)
        left -= shares[oldest]
        for i in sorted(pending[1:], key=lambda i: len(calls[i].pending_prompt)):  # stable: the oldest of equals
            shares[i] = min(len(calls[i].pending_prompt), left)
            left -= shares[i]
        shares[oldest] += min(len(calls[oldest].pending_prompt) - shares[oldest], left)
        return shares

    def chunk(self, call: CallState, share: int) -> PromptChunk:
        """The pending prompt tokens `call` runs in this step's pass, taken off its pending prompt: all that are left
        with its first step when they fit in its `share` of the step's prompt tokens (with a draft tree no more than
        the target's tree_prompt_chunk), otherwise a chunk of that share alone (none: the call sits the step out)."""
        pending = call.pending_prompt
        if pending is None:
            return PromptChunk([])
        if share <= 0:
            return PromptChunk([], decodes=False)
        if len(pending) <= (min(share, self.target.tree_prompt_chunk) if call.resolved.tree else share):
            chunk = PromptChunk(pending)
        else:
            chunk = PromptChunk(pending[:share], decodes=False)
        if call.drafter_context is not None:  # the chunk's tokens among the prompt's last drafter_context
            chunk.features = max(0, len(chunk.tokens) - max(0, len(pending) - call.drafter_context))
        call.pending_prompt = pending[len(chunk.tokens):] or None
        return chunk

    @staticmethod
    def gather(call: CallState, chunk: PromptChunk, out: StepOutput) -> None:
        """Keep the features the pass computed at the prompt's last positions; hand them over once it has run."""
        if chunk.features:
            call.drafter_features.append(out.drafter_features[0])

    @staticmethod
    def hand_features(call: CallState) -> None:
        """A late-features proposer gets the features at the prompt's last positions, before its first tokens."""
        if call.drafter_context is None or call.pending_prompt is not None:
            return
        aux, final = (torch.cat(parts) for parts in zip(*call.drafter_features))
        call.drafter_context, call.drafter_features = None, []
        call.proposer.prompt_features(call.seqs[0].request_id, TargetFeatures(aux, final))

    def _share(self, call: CallState, running: list[CallState]) -> bool:
        """Copy the positions of `call`'s pending prompt that a running call has computed already (agents of one
        framework share its long system prompt). Returns True when a call begun earlier runs the position `call`
        would run next in this step's pass. Positions whose features the proposer reads are always run here."""
        prompt, done = call.seqs[0].tokens, call.cache.lengths[0]
        limit = len(prompt) - 1 - (call.drafter_context or 0)  # positions that may come from elsewhere
        if limit <= done:
            return False
        mine = np.asarray(prompt[:limit], dtype=np.int64)
        best, source, wait = done, None, False
        for other in running:
            if other is call or other.cache is None or other.cache.batch_size != 1:
                continue
            shared = common_prefix(np.asarray(other.seqs[0].tokens, dtype=np.int64), mine)
            if other.cache.usable_prefix(0, min(shared, other.cache.lengths[0])) > best:
                best, source = min(shared, other.cache.lengths[0]), other
            # a call begun earlier whose chunk of this pass runs position `done`, which `call` shares with it
            ahead = other.cache.lengths[0] <= done < min(shared, other.cache.lengths[0] + self.prefill_chunk)
            wait = wait or (ahead and other.pending_prompt is not None and running.index(other) < running.index(call))
        if source is not None:
            call.cache.copy_prefix(0, source.cache, 0, best, start=done)
            call.pending_prompt = prompt[best:-1] or None
            call.stats.prefill_tokens -= best - done
            return self._share(call, running)  # a copy from one may leave positions another runs
        return wait

    def _no_hidden(self, layers: int) -> torch.Tensor:
        return torch.zeros(0, layers * self.target.hidden_size, device=self.target.device)
