"""One call's state as the decode step works on it (`CallState`, its sequences), and `Stream`, a call's text deltas."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator

import torch

from hybridspec.grammar.constraint import Constraint
from hybridspec.runtime.commit import StopRules, cut_at_stop
from hybridspec.model.kv_cache import KVCache
from hybridspec.runtime.options import CallParams
from hybridspec.proposal import FeatureProposer, Proposer
from hybridspec.speculators import TargetFeatures
from hybridspec.runtime.stats import GenerationResult, GenerationStats
from hybridspec.model.inputs import StepOutput
from hybridspec.verifier import process_logits


@dataclass
class SequenceState:
    request_id: Hashable
    tokens: list[int]  # committed: prompt + generated; the cache row holds all but the last
    prompt_len: int
    finish_reason: str | None = None
    extends: Hashable | None = None  # a finished request whose prompt + response this prompt begins with

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass(eq=False)
class CallState:
    """What one generate / stream / send call works on. Cache row r belongs to seqs[rows[r]]."""

    seqs: list[SequenceState]
    cache: KVCache | None  # taken when the call begins
    proposer: Proposer | FeatureProposer | None
    params: CallParams
    rules: StopRules
    stats: GenerationStats
    rows: list[int]  # the sequences still generating, by cache row
    started: list[Hashable] = field(default_factory=list)  # request ids started on the proposer
    pending_prompt: list[int] | None = None  # a single prompt's uncached tokens not run yet (in its steps' passes)
    # the prompt's last positions whose target features the proposer reads, while the prompt runs in steps
    drafter_context: int | None = None
    drafter_features: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # gathered so far
    constraints: list[Constraint] | None = None  # each sequence's grammar state, where a grammar constrains it
    error: Exception | None = None  # what ended the call in a step another thread ran
    cancelled: bool = False  # its caller gave up (`Stream.cancel`): it never starts, or leaves at its next step
    start: float = field(default_factory=time.perf_counter)

    @property
    def wants_target_features(self) -> bool:
        return self.proposer is not None and self.proposer.wants_target_features

    def fail(self, error: Exception) -> None:
        """End the call with `error` (its own thread raises it); its rows leave the step."""
        self.error, self.rows = error, []

    def set_sampling(self) -> None:
        """A proposer that reads features drafts from the distribution the verifier will use."""
        if self.wants_target_features:
            p = self.params
            self.proposer.set_sampling(None if p.temperature == 0 else functools.partial(
                process_logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p), p.generator)

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

    def text(self, seq: SequenceState, decode: Callable[[list[int]], str]) -> str:
        text = decode(seq.generated)
        return cut_at_stop(text, self.params.stop) if seq.finish_reason == "stop" else text

    def results(self, decode: Callable[[list[int]], str]) -> list[GenerationResult]:
        results = [GenerationResult(text=self.text(s, decode), token_ids=s.generated, finish_reason=s.finish_reason,
                                    prompt_token_ids=s.tokens[:s.prompt_len], stats=self.stats) for s in self.seqs]
        if self.params.tools:  # the call could call its tools: its text's calls, parsed
            from hybridspec.grammar.tool_calls import parse_tool_calls

            for result in results:
                result.content, result.tool_calls = parse_tool_calls(result.text)
        return results


class Stream:
    """One call's text deltas, as its tokens are committed. `result` is its GenerationResult once the iteration has
    ended (None if cancelled); `close()` ends the call from the thread that iterates (its requests are aborted, its
    place and KV freed); `cancel()` from any other: a waiting call never runs, a running one leaves the batch at its
    next step and the iteration ends there."""

    def __init__(self, call: CallState, steps: Iterator[None], decode: Callable[[list[int]], str],
                 cancel: Callable[[CallState], None]) -> None:
        self._call, self._steps, self._decode, self._cancel, self._sent = call, steps, decode, cancel, ""
        self.result: GenerationResult | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        seq = self._call.seqs[0]
        for _ in self._steps:
            text = self._call.text(seq, self._decode)
            if seq.finish_reason is None and text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 character: wait for the rest of its bytes
            if len(text) > len(self._sent):
                delta, self._sent = text[len(self._sent):], text
                return delta
        if self.result is None and self._call.error is None and not self._call.cancelled:
            self.result = self._call.results(self._decode)[0]
        raise StopIteration

    def close(self) -> None:
        self._cancel(self._call)  # a stream never iterated gives up its place in line here
        self._steps.close()

    def cancel(self) -> None:
        self._cancel(self._call)
