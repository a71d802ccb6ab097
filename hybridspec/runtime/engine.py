"""Engine: generation on a target model with speculative decoding, the Python API for agent frameworks.

    engine = Engine.from_pretrained("smollm2")
    result = engine.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)      # speculate="suffix"
    options = SamplingOptions(temperature=0.7, max_new_tokens=128)                         # one validated object
    for delta in engine.stream("Once upon a time", options): print(delta, end="")
    session = engine.session(system="You are an agent.")                                     # agent loops
    reply = session.send("ls -la")                  # later turns reuse the KV cache and the suffix cache

A call's life: the caller's thread checks its options and prompt and submits it (`submit`); the engine's loop
(`runtime/loop.py`) admits it, begins it here (`_begin`: its cache, its requests on the proposer), runs its steps with
every other running call's (`runtime/scheduler.py` plans each step, `runtime/step.py` runs it), hands its text to
its `RequestHandle` as it is committed, and ends it (`_end`). Outputs are exact: greedy speculative decoding returns
the target's greedy tokens and sampling keeps the target's distribution (the verifier's rules); speculation only
changes how many tokens one pass commits.
"""
from __future__ import annotations

import itertools
import os
import time
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch

from hybridspec.grammar.constraint import GrammarCompiler
from hybridspec.model.calibration import machine_verify_cost
from hybridspec.model.target import TargetModel
from hybridspec.proposal import Proposal
from hybridspec.router import CostGate, Router, as_router
from hybridspec.runtime.admission import Admission, Limits
from hybridspec.runtime.call import CallState, SequenceState
from hybridspec.runtime.commit import StopRules
from hybridspec.runtime.handle import RequestHandle
from hybridspec.runtime.loop import EngineLoop
from hybridspec.runtime.options import DEFAULT_OPTIONS, SamplingOptions, make_options, resolve
from hybridspec.runtime.prefill import Prefill
from hybridspec.runtime.prefix_cache import PREFIX_CACHE_BYTES, PrefixCache
from hybridspec.runtime.prompts import PromptLike, encode_prompt, is_batch, is_messages, longest_token_chars
from hybridspec.runtime.proposers import SPECULATE_CHOICES, Proposers
from hybridspec.runtime.scheduler import Scheduler
from hybridspec.runtime.session import Session
from hybridspec.runtime.stats import GenerationResult, GenerationStats
from hybridspec.runtime.step import StepRunner
from hybridspec.runtime.text import SequenceText
from hybridspec.speculators.proposer import DEFAULT_DRAFTER_CONTEXT
from hybridspec.speculators.registry import DRAFTER_KINDS

__all__ = ["Engine", "SamplingOptions", "GenerationResult", "GenerationStats", "RequestHandle", "Session",
           "DRAFTER_KINDS", "SPECULATE_CHOICES"]

# Prompt tokens a decode step runs (chunked prefill; `Prefill.allot` shares them), in the pass of the other calls'
# steps: they wait a step of about this many tokens' compute rather than a whole prompt's; 512 ran
# fastest at four agents on this CPU (docs/history.md, "The prefill chunk of 512").
PREFILL_CHUNK = 512


class Engine:
    """Generates with a `TargetModel`, speculating with a suffix cache, an n-gram proposer, a model drafter (P-EAGLE,
    the LSTM speculator, EAGLE-3) or any `Proposer` / `FeatureProposer` (the contract in `hybridspec.proposal`).

    verify_cost: what a verification pass costs, which the default router plans with: "auto" (this machine's
    table for this model, measured on first use and kept in the user cache: `hybridspec.model.calibration`), None
    (the built-in tables of `hybridspec.router.cost`), or a table / the JSON path of one (`CostGate`).
    drafters, drafter_bf16: see `hybridspec.runtime.proposers.Proposers`. A drafter reads the target's hidden states
    at the last `drafter_context` positions of a prompt, then at every committed token, lazily (when it drafts) and
    never more than that many positions (`DrafterProposer`'s own bound). router: a `Router` (default: the `CostGate`
    over `verify_cost`), or a plain function (proposals, contexts) -> proposals. prefix_cache_bytes: the budget of
    automatic prefix caching (`hybridspec.runtime.prefix_cache`): the KV of recent requests, reused by any later call
    whose prompt begins with the same tokens (None: PREFIX_CACHE_BYTES; 0: off). chat_template: a Jinja chat
    template (its text) that renders chat prompts instead of the tokenizer's own.

    Admission (`hybridspec.runtime.admission`): at most `max_num_seqs` calls run at once, their caches within
    `kv_cache_memory` bytes of KV (default: what keeps the process within about half of the machine's memory); later
    calls wait in arrival order, at most `max_waiting` of them (one more raises `QueueFull`).

    One Engine may serve several threads: its loop (`hybridspec.runtime.loop`) runs every running call's step in one
    pass of the target, which verifies every sequence's draft. A single prompt's uncached
    tokens run in those passes too, `prefill_chunk` prompt tokens per step, half to the oldest prompt and the rest
    shortest first (its last chunk with its first step), so the others go on decoding while it prefills (chunked
    prefill); the positions another running call has run of the same tokens are copied from that call (in-flight
    prefix sharing): `hybridspec.runtime.prefill`.
    """

    def __init__(self, target: TargetModel, tokenizer: Any, *, verify_cost: Any = "auto",
                 router: Router | Callable[[Sequence[Proposal], Sequence[int]], list[Proposal]] | None = None,
                 suffix_cache: Any = None, num_speculative_tokens: int = 16,
                 drafters: Mapping[str, str | os.PathLike | Any] | None = None,
                 drafter_context: int = DEFAULT_DRAFTER_CONTEXT,
                 drafter_bf16: bool | None = None, prefix_cache_bytes: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, chat_template: str | None = None,
                 max_num_seqs: int | None = None, kv_cache_memory: int | None = None,
                 max_waiting: int | None = None):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target, self.tokenizer = target, tokenizer
        measured = router is None and verify_cost == "auto"  # this machine's costs: verification's and drafters'
        if router is None:
            router = CostGate(machine_verify_cost(target) if measured else verify_cost)
        self.router: Router = as_router(router)
        self.num_speculative_tokens = num_speculative_tokens
        self.proposers = Proposers(target, self.router, num_speculative_tokens, suffix_cache, drafters, drafter_bf16,
                                   drafter_context, measure_draft_cost=measured)
        self.eos_token_ids = self._eos_ids()
        self.chat_template = chat_template
        self.grammars = GrammarCompiler(tokenizer, target.vocab_size, self.eos_token_ids)
        self.stats = GenerationStats()  # cumulative over every call
        budget = PREFIX_CACHE_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix_cache: PrefixCache | None = PrefixCache(budget) if budget > 0 else None
        self.admission = Admission(Limits.default(budget, max_num_seqs, kv_cache_memory, max_waiting))
        self.prefill = Prefill(target, self.prefix_cache, prefill_chunk, drafter_context)
        self.step = StepRunner(target, self.router, self.prefill, self.prefix_cache)
        self.passes = self.step.passes  # the target's passes by kind, cumulative (the server's pass-time counters)
        self.loop = EngineLoop(self.admission, Scheduler(self.prefill), self.step, self._begin, self._end)
        self.proposers.exclusive = self.loop.paused  # a proposer made on first use is made between steps
        self._request_ids = itertools.count()
        self._token_chars: int | None = None  # the longest token's characters: a prompt's least tokens, at a glance

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "smollm2", dtype: torch.dtype = torch.float32,
                        max_model_len: int | None = None, **kwargs: Any) -> "Engine":
        """An engine on "smollm2" (the embedded model, converted on first use) or a local Hugging Face directory;
        max_model_len: the context (default: the model's; `hybridspec serve --max-model-len`)."""
        from hybridspec.model.loading import load_tokenizer

        return cls(TargetModel.from_pretrained(name_or_path, dtype=dtype, max_seq_len=max_model_len),
                   load_tokenizer(name_or_path), **kwargs)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (getattr(self.target.model, "generation_config", None), self.target.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update([value] if isinstance(value, int) else value or [])
        return frozenset(ids)

    @property
    def suffix_cache(self):
        """The engine's suffix cache: prompts of live requests and every finished response (shared by all calls)."""
        return self.proposers.suffix_cache

    def save_cache(self, path: str | os.PathLike) -> None:
        """Save the suffix cache's global tree (past responses), e.g. between runs of an agent."""
        self.suffix_cache.save(path)

    def load_cache(self, path: str | os.PathLike) -> None:
        self.suffix_cache.load(path)

    # ------------------------------------------------------------------------------------------------ public API

    def encode(self, prompt: PromptLike, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of a prompt: text as is, chat messages through the chat template (with `tools` where given), or
        token ids."""
        if self._token_chars is None:
            self._token_chars = longest_token_chars(self.tokenizer)
        if not is_messages(prompt):  # tools are part of a chat prompt only
            return encode_prompt(self.tokenizer, prompt, self.target.vocab_size, self.target.max_seq_len,
                                 token_chars=self._token_chars)
        return encode_prompt(self.tokenizer, prompt, self.target.vocab_size, self.target.max_seq_len, tools=tools,
                             chat_template=self.chat_template, token_chars=self._token_chars)

    def generate(self, prompt_or_messages: PromptLike | Sequence[PromptLike], options: SamplingOptions | None = None,
                 **overrides: Any) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (text, chat messages or token ids), or a list of prompts as one batch, with
        `options` (default: `SamplingOptions()`) and any of its fields overridden by keyword
        (`generate(prompt, max_new_tokens=64, temperature=0.7)`). With tools the calls come back parsed in the
        result's `tool_calls` (and the rest of the text in `content`). Blocks until the call has ended; its steps run
        on the engine's loop, beside every other call's."""
        batch = is_batch(prompt_or_messages)
        handle = self.submit(list(prompt_or_messages) if batch else [prompt_or_messages],
                             make_options(options, overrides))
        results = handle.wait()
        return results if batch else results[0]

    def stream(self, prompt_or_messages: PromptLike, options: SamplingOptions | None = None,
               **overrides: Any) -> RequestHandle:
        """Generate for one prompt: its handle, whose iteration yields text deltas as tokens are committed
        (`.result` once it has ended; `.cancel()` ends it early). The prompt and options are checked here."""
        return self.submit([prompt_or_messages], make_options(options, overrides), streamed=True)

    def session(self, system: str | None = None, options: SamplingOptions | None = None, **defaults: Any) -> Session:
        """A multi-turn conversation that keeps its KV cache and feeds the suffix cache turn after turn, each turn
        with `options` (and `defaults` over them, e.g. speculate="suffix", max_new_tokens=256)."""
        return Session(self, system=system, options=make_options(options, defaults))

    def submit(self, prompts: Sequence[PromptLike], options: SamplingOptions = DEFAULT_OPTIONS,
               streamed: bool = False) -> RequestHandle:
        """Check a call (its options against the proposer they name, its prompts, its grammar) and put it in line
        for the loop; its handle (streamed: its `Delta`s come as they are committed, every sequence's). `QueueFull`
        if the line is full; an `InvalidParameter` names a bad input. A call dropped before it ran leaves nothing
        behind. Prompts that are the same run once and share their KV (n samples of one prompt)."""
        resolved = resolve(options, self.proposers.get, self.num_speculative_tokens)
        ids = [self.encode(p, options.tools) for p in prompts]
        constraints = None
        if options.grammar is not None:
            compiled = self.grammars.compile(options.grammar)
            param = "tools" if options.grammar.kind == "tools" else "response_format"
            constraints = [self.grammars.constraint(compiled, param) for _ in ids]
        handle = RequestHandle()
        seqs = [SequenceState(f"hs-{next(self._request_ids)}", tokens, len(tokens),
                              SequenceText(self._decode, options.stop, options.call_tools is not None))
                for tokens in ids]
        eos = frozenset() if options.ignore_eos else self.eos_token_ids
        rules = StopRules(eos, options.max_new_tokens, self.target.max_seq_len)
        call = CallState(seqs, options, resolved, rules, weakref.ref(handle), constraints=constraints,
                         streamed=streamed)
        self.loop.submit(call, self.prefill.kv_bytes(call))
        return handle

    # ----------------------------------------------------------------------------------------- a call, in the loop

    def _begin(self, call: CallState) -> None:
        """Take the call's cache and run or schedule its prompts (`Prefill.begin`), then start each sequence on the
        proposer as one request (which continues the earlier request it extends)."""
        features = self.prefill.begin(call)
        if call.proposer is None:
            return
        call.set_sampling()
        for seq, feats in zip(call.seqs, features):
            extra = {"features": feats} if call.wants_target_features else {}
            call.proposer.start_request(seq.request_id, list(seq.tokens), extends=seq.extends, **extra)
            call.started.append(seq.request_id)

    def _end(self, call: CallState) -> None:
        done = all(s.finish_reason is not None for s in call.seqs)
        for rid in call.started:
            (call.proposer.finish_request if done else call.proposer.abort_request)(rid)
        call.started, call.cache = [], None  # the prefix cache keeps what it stored of it
        call.stats.calls += 1
        call.stats.total_s += time.perf_counter() - call.start
        self.stats.add(call.stats)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
