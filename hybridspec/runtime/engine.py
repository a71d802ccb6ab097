"""Engine: generation on a target model with speculative decoding, the Python API for agent frameworks.

    engine = Engine.from_pretrained("smollm2")
    result = engine.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)      # speculate="suffix"
    for delta in engine.stream("Once upon a time", max_new_tokens=32): print(delta, end="")
    session = engine.session(system="You are an agent.")                                     # agent loops
    reply = session.send("ls -la")                  # later turns reuse the KV cache and the suffix cache

This file is the API and a call's life: begin (its prompt, `prefill`), decode steps until every sequence finished
(`step`: propose -> route -> verify -> update, shared with the calls of other threads by `scheduler`), end. Outputs
are exact: greedy speculative decoding returns the target's greedy tokens and sampling keeps the target's
distribution (the verifier's rules); speculation only changes how many tokens one pass commits. The rooms around
it: `options` (a call's options), `proposers` (speculate= names), `commit` (stop rules), `prompts` (text, chat,
token ids), `session` (`Session`), `prefix_cache` (the cache policy), `stats` (what a call returns).
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from hybridspec.grammar.constraint import GrammarCompiler
from hybridspec.model.calibration import machine_verify_cost
from hybridspec.model.machine import release_free_memory
from hybridspec.model.target import TargetModel
from hybridspec.proposal import FeatureProposer, Proposal, Proposer
from hybridspec.router import CostGate, Router, as_router
from hybridspec.runtime.admission import Admission, Limits
from hybridspec.runtime.call import CallState, SequenceState, Stream
from hybridspec.runtime.commit import StopRules
from hybridspec.runtime.options import DEFAULTS, GenerateOptions, resolve_options
from hybridspec.runtime.prefill import Prefill
from hybridspec.runtime.prefix_cache import PREFIX_CACHE_BYTES, PrefixCache
from hybridspec.runtime.prompts import PromptLike, encode_prompt, is_batch, is_messages
from hybridspec.runtime.proposers import SPECULATE_CHOICES, Proposers
from hybridspec.runtime.scheduler import StepScheduler
from hybridspec.runtime.session import Session
from hybridspec.runtime.stats import GenerationResult, GenerationStats
from hybridspec.runtime.step import StepRunner
from hybridspec.speculators.proposer import DEFAULT_DRAFTER_CONTEXT
from hybridspec.speculators.registry import DRAFTER_KINDS

__all__ = ["Engine", "GenerateOptions", "GenerationResult", "GenerationStats", "Session", "Stream", "DRAFTER_KINDS",
           "SPECULATE_CHOICES"]

# Prompt tokens a decode step runs (chunked prefill; `Prefill.allot` shares them), in the pass of the other calls'
# steps: they wait a step of about this many tokens' compute rather than a whole prompt's; 512 ran
# fastest at four agents on this CPU (BENCHMARKS.md, the chunk size sweep).
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

    Admission (`hybridspec.runtime.admission`): at most `max_running_calls` calls run at once, their caches within
    `kv_budget_bytes` of KV (default: what keeps the process within about half of the machine's memory); later calls
    wait in arrival order, at most `max_waiting_calls` of them (one more raises `QueueFull`).

    One Engine may serve several threads (`hybridspec.runtime.scheduler`): each call's decode steps join those of the
    calls decoding then, and one pass of the target verifies every sequence's draft. A single prompt's uncached
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
                 max_running_calls: int | None = None, kv_budget_bytes: int | None = None,
                 max_waiting_calls: int | None = None):
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
        self.admission = Admission(Limits.default(budget, max_running_calls, kv_budget_bytes, max_waiting_calls))
        self._running: list[CallState] = []  # calls begun and not ended, oldest first (a step may hold some of them)
        self.prefill = Prefill(target, self.prefix_cache, self._running, prefill_chunk, drafter_context)
        self.step = StepRunner(target, self.router, self.prefill, self.prefix_cache, self._decode)
        self.passes = self.step.passes  # the target's passes by kind, cumulative (the server's pass-time counters)
        self.scheduler: StepScheduler[CallState] = StepScheduler(self.step, running=lambda: len(self._running))
        self._request_ids = itertools.count()

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "smollm2", dtype: torch.dtype = torch.float32,
                        max_seq_len: int | None = None, **kwargs: Any) -> "Engine":
        """An engine on "smollm2" (the embedded model, converted on first use) or a local Hugging Face directory."""
        from hybridspec.model.loading import load_tokenizer

        return cls(TargetModel.from_pretrained(name_or_path, dtype=dtype, max_seq_len=max_seq_len),
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
        if not is_messages(prompt):  # tools are part of a chat prompt only
            return encode_prompt(self.tokenizer, prompt, self.target.vocab_size, self.target.max_seq_len)
        return encode_prompt(self.tokenizer, prompt, self.target.vocab_size, self.target.max_seq_len, tools=tools,
                             chat_template=self.chat_template)

    def generate(self, prompt_or_messages: PromptLike | Sequence[PromptLike],
                 max_new_tokens: int = DEFAULTS.max_new_tokens, temperature: float = DEFAULTS.temperature,
                 top_p: float = DEFAULTS.top_p, top_k: int = DEFAULTS.top_k,
                 speculate: str | Proposer | FeatureProposer | None = DEFAULTS.speculate,
                 num_speculative_tokens: int | None = DEFAULTS.num_speculative_tokens,
                 tree: bool | None = DEFAULTS.tree, stop: str | Sequence[str] | None = DEFAULTS.stop,
                 seed: int | None = DEFAULTS.seed, response_format: Mapping[str, Any] | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
                 parallel_tool_calls: bool = DEFAULTS.parallel_tool_calls,
                 grammar_drafts: bool = DEFAULTS.grammar_drafts) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (text, chat messages or token ids), or a list of prompts as one batch.

        temperature 0 is greedy; otherwise sampling with top_k / top_p. speculate: "suffix" (the engine's suffix
        cache: prompt and past responses), "ngram", a model drafter ("peagle", "lstm", "eagle3"; num_speculative_tokens
        then defaults to the K it was trained for), a hybrid ("suffix+peagle", ...: the suffix draft where the text
        repeats, the drafter's elsewhere), "none", or a Proposer. tree=True drafts token trees: the suffix cache's, or a
        drafter's greedy chain with its runner-up tokens as siblings; num_speculative_tokens then counts tree nodes.
        tree=None (default) lets the proposer choose: trees for drafters and hybrids, chains for the suffix cache
        (the faster on a CPU, where verifying many tokens costs more than a plain step).
        Stops at EOS, at any of `stop` (the text is cut before it), or after max_new_tokens.

        Structured output, as OpenAI's API defines it: response_format {"type": "json_object"} or {"type":
        "json_schema", "json_schema": {"schema": ..., "strict": ...}}; tools (function tools, rendered by the chat
        template) with tool_choice "auto" (text, or calls once one starts), "required", a named function
        ({"type": "function", "function": {"name": ...}}) or "none", and parallel_tool_calls. The calls come back
        parsed in the result's `tool_calls` (and the rest of the text in `content`). Decoding follows the grammar
        exactly as plain constrained decoding would; drafts are checked against it, and with grammar_drafts the
        tokens it forces are drafted too (source "grammar" in the stats).
        """
        batch = is_batch(prompt_or_messages)
        call = self._start_call(list(prompt_or_messages) if batch else [prompt_or_messages], dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, speculate=speculate,
            num_speculative_tokens=num_speculative_tokens, tree=tree, stop=stop, seed=seed,
            response_format=response_format, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls, grammar_drafts=grammar_drafts))
        for _ in self._steps(call):
            pass
        results = call.results(self._decode)
        return results if batch else results[0]

    def stream(self, prompt_or_messages: PromptLike, **options: Any) -> Stream:
        """Generate for one prompt, yielding text deltas as tokens are committed (keyword arguments of `generate`).
        The prompt and options are checked here, before the first delta is asked for."""
        call = self._start_call([prompt_or_messages], options)
        return Stream(call, self._steps(call), self._decode, self._cancel)

    def session(self, system: str | None = None, **defaults: Any) -> Session:
        """A multi-turn conversation that keeps its KV cache and feeds the suffix cache turn after turn.

        `defaults` are `generate` arguments used for every turn (e.g. speculate="suffix", max_new_tokens=256)."""
        return Session(self, system=system, **defaults)

    # ------------------------------------------------------------------------------------------------ a call

    def _start_call(self, prompts: Sequence[PromptLike], options: Mapping[str, Any]) -> CallState:
        """A call's validated options, proposer and sequences (one per prompt), in line for admission (`QueueFull`
        if the line is full); it holds nothing shared until it begins (`_begin`), so a call dropped before its first
        step leaves nothing behind but its place in line (`Stream.close` gives that up)."""
        with self.scheduler.lock:  # proposers load lazily
            params, proposer = resolve_options(options, self.proposers.get, self.num_speculative_tokens)
        seqs = [SequenceState(request_id=f"hs-{next(self._request_ids)}", tokens=ids, prompt_len=len(ids))
                for ids in (self.encode(p, options.get("tools")) for p in prompts)]
        rules = StopRules(self.eos_token_ids, params.max_new_tokens, self.target.max_seq_len)
        constraints = None
        if params.grammar is not None:
            compiled = self.grammars.compile(params.grammar)
            constraints = [self.grammars.constraint(compiled) for _ in seqs]
        call = CallState(seqs, None, proposer, params, rules, GenerationStats(), rows=list(range(len(seqs))),
                         constraints=constraints)
        self.admission.enqueue(call, self.prefill.kv_bytes(call))
        return call

    def _steps(self, call: CallState) -> Iterator[None]:
        """Run a call: wait for admission, prefill and start its requests on the proposer, then decode steps (shared
        with the calls of other threads) until every sequence finished or the call is cancelled; yields after each
        step."""
        try:
            queued = self.admission.wait(call)
        except BaseException:
            self.admission.leave(call)
            raise
        if queued is None:  # cancelled while it waited: it never ran
            return
        call.stats.queue_s = queued
        try:
            with self.scheduler.lock:
                self._running.append(call)
                self._begin(call)
            self.admission.hold(call, call.cache.nbytes)
            while call.rows and not call.cancelled:
                self.scheduler.join_step(call)
                if call.error is not None:
                    raise call.error
                yield
        finally:  # also when a caller abandons its stream: its requests are aborted, its place and KV freed
            with self.scheduler.lock:
                self._running.remove(call)
                self._end(call)
                idle = not self._running
            self.admission.leave(call)
            if idle:
                release_free_memory()

    def _cancel(self, call: CallState) -> None:
        """End a call from any thread: it leaves the line if it waits, the batch after its current step if it runs."""
        call.cancelled = True
        self.admission.cancel(call)

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
