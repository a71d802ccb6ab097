"""One call's state as the engine's loop works on it (`CallState`, its sequences). The loop thread alone touches it
once the call is submitted; its caller reads what the loop hands over through the call's `RequestHandle`."""
from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Hashable

import torch

from hybridspec.grammar.constraint import Constraint
from hybridspec.model.inputs import StepOutput
from hybridspec.model.kv_cache import KVCache
from hybridspec.proposal import FeatureProposer, Proposer
from hybridspec.runtime.commit import StopRules
from hybridspec.runtime.handle import Delta, RequestHandle
from hybridspec.runtime.options import Resolved, SamplingOptions
from hybridspec.runtime.stats import GenerationResult, GenerationStats, TokenLogprob
from hybridspec.runtime.text import SequenceText
from hybridspec.speculators import TargetFeatures
from hybridspec.verifier import process_logits


@dataclass(eq=False)
class SequenceState:
    request_id: Hashable
    tokens: list[int]  # committed: prompt + generated; the cache row holds all but the last
    prompt_len: int
    text: SequenceText  # the generated tokens as text, decoded as they are committed
    finish_reason: str | None = None
    extends: Hashable | None = None  # a finished request whose prompt + response this prompt begins with
    logprobs: list[TokenLogprob] | None = None  # one per generated token, where the call asks for them
    logprobs_sent: int = 0  # of those, handed to the caller already

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def delta(self, index: int, finished: bool = False) -> Delta | None:
        """What this sequence added since its last delta (its text released whole once it has finished)."""
        text, events = self.text.release(finished or self.finish_reason is not None)
        logprobs = self.logprobs[self.logprobs_sent:] if self.logprobs is not None else []
        self.logprobs_sent += len(logprobs)
        return Delta(index, text, events, logprobs) if text or events or logprobs else None


@dataclass(eq=False)
class CallState:
    """What one generate / stream / send call works on. Cache row r belongs to seqs[rows[r]]."""

    seqs: list[SequenceState]
    options: SamplingOptions
    resolved: Resolved  # the options resolved against the engine: proposer, draft budget, trees, generator
    rules: StopRules
    handle_ref: weakref.ref[RequestHandle]  # its caller's handle (gone: the caller dropped it, as a cancel)
    stats: GenerationStats = field(default_factory=GenerationStats)
    rows: list[int] = field(default_factory=list)  # the sequences still generating, by cache row
    cache: KVCache | None = None  # taken when the call begins
    started: list[Hashable] = field(default_factory=list)  # request ids started on the proposer
    pending_prompt: list[int] | None = None  # a single prompt's uncached tokens not run yet (in its steps' passes)
    # the prompt's last positions whose target features the proposer reads, while the prompt runs in steps
    drafter_context: int | None = None
    drafter_features: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # gathered so far
    constraints: list[Constraint] | None = None  # each sequence's grammar state, where a grammar constrains it
    error: Exception | None = None  # what ended the call in a step
    streamed: bool = False  # its caller reads its deltas (else only its results)
    start: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.rows = list(range(len(self.seqs)))
        if self.options.logprobs is not None:
            for seq in self.seqs:
                seq.logprobs = []

    @property
    def proposer(self) -> Proposer | FeatureProposer | None:
        return self.resolved.proposer

    @property
    def wants_target_features(self) -> bool:
        return self.proposer is not None and self.proposer.wants_target_features

    @property
    def handle(self) -> RequestHandle | None:
        return self.handle_ref()

    @property
    def cancelled(self) -> bool:
        handle = self.handle_ref()
        return handle is None or handle.cancelled

    @property
    def done(self) -> bool:
        """Nothing left to run: every sequence finished, the call failed, or its caller cancelled it."""
        return not self.rows or self.error is not None or self.cancelled

    def fail(self, error: Exception) -> None:
        """End the call with `error` (its caller raises it); its rows leave the step."""
        self.error, self.rows = error, []

    def set_sampling(self) -> None:
        """A proposer that reads features drafts from the distribution the verifier will use."""
        if self.wants_target_features:
            o = self.options
            self.proposer.set_sampling(None if o.greedy else functools.partial(
                process_logits, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p), self.resolved.generator)

    def feed_proposer(self, row: int, seq: SequenceState, committed: list[int], out: StepOutput,
                      kept_slots: list[int]) -> None:
        """Tell the proposer the committed tokens (a drafter also gets the target's features at the slots that
        produced them)."""
        if self.proposer is None:
            return
        if self.wants_target_features:
            slots = torch.tensor(kept_slots[:len(committed)], device=out.logits.device)
            self.proposer.append(seq.request_id, committed, features=TargetFeatures(
                out.aux_hidden[row, slots], out.final_hidden[row, slots]))
        else:
            self.proposer.append(seq.request_id, committed)

    def deltas(self, finished: bool = False) -> list[Delta]:
        """What each sequence added since the last deltas."""
        return [d for i, seq in enumerate(self.seqs) if (d := seq.delta(i, finished)) is not None]

    def results(self) -> list[GenerationResult]:
        """Each sequence's result, once every one has finished (its text released whole)."""
        results = []
        for seq in self.seqs:
            seq.text.release(finished=True)
            result = GenerationResult(text=seq.text.text, token_ids=seq.generated, finish_reason=seq.finish_reason,
                                      prompt_token_ids=seq.tokens[:seq.prompt_len], stats=self.stats,
                                      logprobs=seq.logprobs, stop=seq.text.stop)
            if self.options.call_tools is not None:  # the call could call its tools: its text's calls, parsed
                result.content, result.tool_calls = seq.text.tool_calls()
            results.append(result)
        return results
