"""What a call returns: `GenerationResult` per sequence and `GenerationStats`, its counters and wall time.

One name per concept across the engine, the vLLM plugin, the server's metrics and the benchmarks' JSON:
`draft_tokens` are draft tokens sent to verification, `accepted_tokens` those the target accepted, `drafts` the
verification passes that carried a draft, and a draft's `source` names the proposer that made it ("suffix", "peagle",
"ngram", ...).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator


@dataclass
class SourceStats:
    """One draft source's share of a call's steps."""

    won: int = 0  # steps whose proposer drafted from this source (a hybrid: the source its choice picked)
    drafts: int = 0  # of those, steps that verified a draft (the router kept some of it)
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, other: "SourceStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class PassTimes:
    """The target's passes over an engine's life, by what they ran: `prompt` passes ran prompt tokens (a call's
    prefill chunk, with other calls' decode rows beside), `decode` passes only decode rows. Where a server's time goes
    under load: speculation shortens the decode passes, never the prompt ones."""

    prompt_s: float = 0.0
    decode_s: float = 0.0
    prompt_passes: int = 0
    decode_passes: int = 0

    def count(self, seconds: float, prompt: bool) -> None:
        if prompt:
            self.prompt_s, self.prompt_passes = self.prompt_s + seconds, self.prompt_passes + 1
        else:
            self.decode_s, self.decode_passes = self.decode_s + seconds, self.decode_passes + 1


@dataclass
class GenerationStats:
    """Counters and wall time of one call (summed over its sequences), or cumulative over many calls."""

    calls: int = 0
    sequences: int = 0  # prompts run (one per sequence of a batch)
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run (the rest came from the prefix cache or a session's KV)
    new_tokens: int = 0
    steps: int = 0  # verification passes, counted per sequence
    draft_tokens: int = 0  # draft tokens sent to verification
    accepted_tokens: int = 0  # of those, accepted
    proposals: int = 0  # non-empty proposals from the proposer
    skipped_proposals: int = 0  # of those, dropped by the router (not worth a verification pass)
    drafter_runs: int = 0  # steps that ran a model drafter (a hybrid runs it only where it is expected to pay)
    prefill_s: float = 0.0
    propose_s: float = 0.0  # proposer and router
    verify_s: float = 0.0  # target forward pass and acceptance rule
    update_s: float = 0.0  # KV cache commit, proposer update, stop rules
    total_s: float = 0.0
    first_token_s: float = 0.0  # from the call until its first generated token was committed (time to first token)
    queue_s: float = 0.0  # waiting for admission (part of total_s and first_token_s)
    by_source: dict[str, SourceStats] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused (prefix cache, a session's earlier turns). A prompt's last token is the
        first step's input, never prefilled, and counts as neither."""
        return max(0, self.prompt_tokens - self.prefill_tokens - self.sequences)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def decode_s(self) -> float:
        return self.propose_s + self.verify_s + self.update_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0

    def count_step(self, source: str | None, draft_tokens: int, accepted_tokens: int, new_tokens: int,
                   drafter_ran: bool = False) -> None:
        """One sequence's verification pass: `source` made its proposal (None: no proposal), of which the router
        kept `draft_tokens` for verification; drafter_ran: a model drafter ran for it."""
        self.steps += 1
        self.drafter_runs += drafter_ran
        self.new_tokens += new_tokens
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens
        if source is not None:
            counts = self.source(source)
            counts.won += 1
            counts.drafts += draft_tokens > 0
            counts.draft_tokens += draft_tokens
            counts.accepted_tokens += accepted_tokens

    def count_source(self, name: str, draft_tokens: int, accepted_tokens: int) -> None:
        """Draft tokens of a step from a second source (the tokens a grammar forced after the proposer's draft):
        counted under `name` as well as in the step's totals."""
        counts = self.source(name)
        counts.won += 1
        counts.drafts += draft_tokens > 0
        counts.draft_tokens += draft_tokens
        counts.accepted_tokens += accepted_tokens
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens

    def source(self, name: str) -> SourceStats:
        return self.by_source.setdefault(name, SourceStats())

    def add(self, other: "GenerationStats") -> None:
        for f in fields(self):
            if f.name == "by_source":
                for name, counts in other.by_source.items():
                    self.source(name).add(counts)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the wall time of the `with` block to the field `name` (e.g. "verify_s")."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)

    def as_dict(self) -> dict:
        return dict(asdict(self), tokens_per_step=self.tokens_per_step, acceptance=self.acceptance,
                    tokens_per_s=self.tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s,
                    cached_tokens=self.cached_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target (its distribution at temperature 1, under a grammar the
    masked one), and the `top` most probable tokens there with theirs, most probable first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    """One sequence's output. token_ids include a final EOS token when generation stopped on one (text does not)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_token_ids: list[int]
    stats: GenerationStats  # of the whole call (shared by the results of a batch)
    # A call with tools: the text outside its tool calls (None if empty), and the calls in OpenAI's shape
    # ({"id", "type": "function", "function": {"name", "arguments": a JSON string}}); None without tools.
    content: str | None = None
    tool_calls: list[dict] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, where the call asked for them
    stop: str | None = None  # the stop string that ended it (finish_reason "stop")
