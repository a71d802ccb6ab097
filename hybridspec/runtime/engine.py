"""Engine: generation on a target model with speculative decoding, the Python API for agent frameworks.

    engine = Engine.from_pretrained("smollm2")
    result = engine.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)      # speculate="suffix"
    for delta in engine.stream("Once upon a time", max_new_tokens=32): print(delta, end="")
    session = engine.session(system="You are an agent.")                                     # agent loops
    reply = session.send("ls -la")                  # later turns reuse the KV cache and the suffix cache

This file is the API and the decode loop. Every decode step (`Engine._decode_step`) is propose -> route -> verify ->
update, one method each. Outputs are exact: greedy speculative decoding returns the target's greedy tokens and sampling
keeps the target's distribution (the verifier's rules); speculation only changes how many tokens one pass commits.
The rooms around it: `options` (a call's options), `proposers` (speculate= names), `scheduler` (concurrent calls
sharing steps), `commit` (stop rules), `session` (prompts, chat, `Session`), `prefix_cache` (the cache policy),
`stats` (what a call returns).
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from hybridspec.model.calibration import machine_verify_cost
from hybridspec.runtime.call import Call, SequenceState, Stream
from hybridspec.runtime.commit import StopRules, commit_tokens, draft_budget, stop_cut
from hybridspec.runtime.options import DEFAULTS, GenerateOptions, resolve_options
from hybridspec.runtime.prefix_cache import PREFIX_CACHE_BYTES, PrefixCache, cache_for_prompts, common_prefix
from hybridspec.proposal import FeatureProposer, Proposal, Proposer, speculate_each
from hybridspec.runtime.proposers import SPECULATE_CHOICES, Proposers
from hybridspec.router import CostGate, Router, as_router
from hybridspec.runtime.scheduler import StepScheduler, failing
from hybridspec.runtime.prompts import PromptLike, encode_prompt, is_batch
from hybridspec.runtime.session import Session
from hybridspec.speculators import TargetFeatures
from hybridspec.speculators.proposer import DEFAULT_WINDOW
from hybridspec.speculators.registry import DRAFTER_KINDS
from hybridspec.runtime.stats import GenerationResult, GenerationStats
from hybridspec.model.target import StepInput, StepOutput, TargetModel
from hybridspec.verifier import VerifyResult, verify_batch

__all__ = ["Engine", "GenerateOptions", "GenerationResult", "GenerationStats", "Session", "Stream", "DRAFTER_KINDS",
           "SPECULATE_CHOICES"]

KV_HEADROOM_TOKENS = 64  # cache slots past prompt + max_new_tokens: the last step's draft fits without regrowth
# Prompt tokens a call runs per decode step (chunked prefill), in the pass of the other calls' steps: they wait a step
# of about this many tokens' compute rather than the whole prompt's, and so does a call that arrives meanwhile
# (BENCHMARKS.md, issue 25).
PREFILL_CHUNK = 512


class Engine:
    """Generates with a `TargetModel`, speculating with a suffix cache, an n-gram proposer, a model drafter (P-EAGLE,
    the LSTM speculator, EAGLE-3) or any `Proposer` / `FeatureProposer` (the contract in `hybridspec.proposal`).

    verify_cost: what a verification pass costs, which the default router plans with: "auto" (this machine's
    table for this model, measured on first use and kept in the user cache: `hybridspec.model.calibration`), None (the
    built-in tables of `hybridspec.router.cost`), or a table / the JSON path of one (`CostGate`).
    drafters, drafter_bf16: see `hybridspec.runtime.proposers.Proposers`. A drafter reads the target's hidden states at the
    last `drafter_context` positions of a prompt, then at every committed token, lazily (when it drafts) and never
    more than that many positions (`DrafterProposer`'s window). router: a `Router` (default: the
    `CostGate` over `verify_cost`), or a plain function (proposals, contexts) -> proposals. prefix_cache_bytes: the
    budget of automatic prefix caching (`hybridspec.runtime.prefix_cache`): the KV of recent requests, reused by any later
    call whose prompt begins with the same tokens (None: PREFIX_CACHE_BYTES; 0: off).

    One Engine may serve several threads (`hybridspec.runtime.scheduler`): each call's decode steps join those of the calls
    decoding then, and one pass of the target verifies every sequence's draft. A single prompt's uncached tokens run
    in those passes too, `prefill_chunk` tokens per step (its last chunk with its first step), so the others go on
    decoding while it prefills (chunked prefill); the positions another running call has run of the same tokens are
    copied from that call (in-flight prefix sharing).
    """

    # A single prompt's uncached tokens run in its steps' passes (see _prefill); False: in a pass of their own.
    fuse_prefill_with_first_step = True

    def __init__(self, target: TargetModel, tokenizer: Any, *, verify_cost: Any = "auto",
                 router: Router | Callable[[Sequence[Proposal], Sequence[int]], list[Proposal]] | None = None,
                 suffix_cache: Any = None, num_speculative_tokens: int = 16,
                 drafters: Mapping[str, str | os.PathLike | Any] | None = None,
                 drafter_context: int = DEFAULT_WINDOW,
                 drafter_bf16: bool | None = None, prefix_cache_bytes: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target, self.tokenizer = target, tokenizer
        self.prefill_chunk = prefill_chunk
        measured = router is None and verify_cost == "auto"  # this machine's costs: verification's and drafters'
        if router is None:
            router = CostGate(machine_verify_cost(target) if measured else verify_cost)
        self.router: Router = as_router(router)
        self.num_speculative_tokens = num_speculative_tokens
        self.proposers = Proposers(target, self.router, num_speculative_tokens, suffix_cache, drafters, drafter_bf16,
                                   drafter_context, measure_draft_cost=measured)
        self.drafter_context = drafter_context
        self.eos_token_ids = self._eos_ids()
        self.stats = GenerationStats()  # cumulative over every call
        budget = PREFIX_CACHE_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix_cache: PrefixCache | None = PrefixCache(budget) if budget > 0 else None
        self._live: list[Call] = []  # calls begun and not ended, oldest first (a step may hold only some of them)
        self.scheduler: StepScheduler[Call] = StepScheduler(self._decode_step, live=lambda: len(self._live))
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

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a prompt: text as is, chat messages through the tokenizer's chat template, or token ids."""
        return encode_prompt(self.tokenizer, prompt, self.target.vocab_size, self.target.max_seq_len)

    def generate(self, prompt_or_messages: PromptLike | Sequence[PromptLike],
                 max_new_tokens: int = DEFAULTS.max_new_tokens, temperature: float = DEFAULTS.temperature,
                 top_p: float = DEFAULTS.top_p, top_k: int = DEFAULTS.top_k,
                 speculate: str | Proposer | FeatureProposer | None = DEFAULTS.speculate,
                 num_speculative_tokens: int | None = DEFAULTS.num_speculative_tokens,
                 tree: bool | None = DEFAULTS.tree, stop: str | Sequence[str] | None = DEFAULTS.stop,
                 seed: int | None = DEFAULTS.seed) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (text, chat messages or token ids), or a list of prompts as one batch.

        temperature 0 is greedy; otherwise sampling with top_k / top_p. speculate: "suffix" (the engine's suffix
        cache: prompt and past responses), "ngram", a model drafter ("peagle", "lstm", "eagle3"; num_speculative_tokens
        then defaults to the K it was trained for), a hybrid ("suffix+peagle", ...: the suffix draft where the text
        repeats, the drafter's elsewhere), "none", or a Proposer. tree=True drafts token trees: the suffix cache's, or a
        drafter's greedy chain with its runner-up tokens as siblings; num_speculative_tokens then counts tree nodes.
        tree=None (default) lets the proposer choose: trees for drafters and hybrids, chains for the suffix cache
        (the faster on a CPU, where verifying many tokens costs more than a plain step).
        Stops at EOS, at any of `stop` (the text is cut before it), or after max_new_tokens.
        """
        batch = is_batch(prompt_or_messages)
        call = self._start_call(list(prompt_or_messages) if batch else [prompt_or_messages], dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, speculate=speculate,
            num_speculative_tokens=num_speculative_tokens, tree=tree, stop=stop, seed=seed))
        for _ in self._steps(call):
            pass
        results = call.results(self._decode)
        return results if batch else results[0]

    def stream(self, prompt_or_messages: PromptLike, **options: Any) -> Stream:
        """Generate for one prompt, yielding text deltas as tokens are committed (keyword arguments of `generate`).
        The prompt and options are checked here, before the first delta is asked for."""
        call = self._start_call([prompt_or_messages], options)
        return Stream(call, self._steps(call), self._decode)

    def session(self, system: str | None = None, **defaults: Any) -> Session:
        """A multi-turn conversation that keeps its KV cache and feeds the suffix cache turn after turn.

        `defaults` are `generate` arguments used for every turn (e.g. speculate="suffix", max_new_tokens=256)."""
        return Session(self, system=system, **defaults)

    # ------------------------------------------------------------------------------------------------ a call

    def _start_call(self, prompts: Sequence[PromptLike], options: Mapping[str, Any]) -> Call:
        """A call's validated options, proposer and sequences (one per prompt); it holds nothing shared until it
        begins (`_begin`), so a call dropped before its first step leaves nothing behind."""
        with self.scheduler.lock:  # proposers load lazily
            params, proposer = resolve_options(options, self.proposers.get, self.num_speculative_tokens)
        seqs = [SequenceState(request_id=f"hs-{next(self._request_ids)}", tokens=ids, prompt_len=len(ids))
                for ids in map(self.encode, prompts)]
        rules = StopRules(self.eos_token_ids, params.max_new_tokens, self.target.max_seq_len)
        return Call(seqs, None, proposer, params, rules, GenerationStats(), live=list(range(len(seqs))))

    def _steps(self, call: Call) -> Iterator[None]:
        """Run a call: prefill and start its requests on the proposer, then decode steps (shared with the calls of
        other threads) until every sequence finished; yields after each step."""
        call.start = time.perf_counter()
        try:
            with self.scheduler.lock:
                self._live.append(call)
                self._begin(call)
            while call.live:
                self.scheduler.join_step(call)
                if call.error is not None:
                    raise call.error
                yield
        finally:  # also when a caller abandons its stream: its requests are aborted
            with self.scheduler.lock:
                self._live.remove(call)
                self._end(call)

    def _begin(self, call: Call) -> None:
        """Take a cache holding the longest prefix of each prompt the prefix cache has, prefill every prompt past it
        and start each sequence on the proposer as one request (which continues the earlier request it extends)."""
        need = min(max(len(s.tokens) for s in call.seqs) + call.params.max_new_tokens + KV_HEADROOM_TOKENS,
                   self.target.max_seq_len)
        call.cache, extends = cache_for_prompts(
            self.prefix_cache, self.target.new_cache, [s.tokens for s in call.seqs], need, self.target.max_seq_len,
            id(call.proposer) if call.proposer is not None else None,
            self.drafter_context if call.wants_target_features else 0)
        for seq, ext in zip(call.seqs, extends):
            seq.extends = ext
        features = self._prefill(call)
        if call.proposer is None:
            return
        call.set_sampling()
        for seq, feats in zip(call.seqs, features):
            extra = {"features": feats} if call.wants_target_features else {}
            call.proposer.start_request(seq.request_id, list(seq.tokens), extends=seq.extends, **extra)
            call.started.append(seq.request_id)

    def _prefill(self, call: Call) -> list[TargetFeatures | None]:
        """Run each prompt's uncached tokens (all but its last, the first step's input) into the cache; returns the
        target's features at the prompt's last positions when the proposer reads them.

        The one decision about deferring: a single prompt leaves its tokens to its decode steps (`_prompt_chunk`):
        a chunk of them per step, in the passes of the other calls' steps rather than stopping them for the whole
        prompt, and the last chunk with its own first step (the last token and the draft: the weights read once
        rather than twice). A proposer that reads features must take them late (`late_prompt_features`): it
        starts without them, and gets those of the prompt's last positions from the passes that ran them."""
        todo = [seq.tokens[call.cache.lengths[row]:-1] for row, seq in enumerate(call.seqs)]
        call.stats.sequences += len(call.seqs)
        call.stats.prompt_tokens += sum(seq.prompt_len for seq in call.seqs)
        call.stats.prefill_tokens += sum(len(t) for t in todo)
        features: list[TargetFeatures | None] = [None] * len(call.seqs)
        late = not call.wants_target_features or getattr(call.proposer, "late_prompt_features", False)
        if len(todo) == 1 and todo[0] and late and self.fuse_prefill_with_first_step:
            call.deferred_prefill = todo[0]
            if call.wants_target_features:
                call.features_wanted = min(len(todo[0]), self.drafter_context)
            return features  # None: they come later (prompt_features)
        with call.stats.timed("prefill_s"):
            if any(todo):
                out = self.target.prefill(call.cache, todo,
                                          hidden_tail=self.drafter_context if call.wants_target_features else 0)
                if call.wants_target_features:
                    features = [TargetFeatures(aux, final) for aux, final in out.hidden_tail]
            elif call.wants_target_features:  # the prompt's KV is all cached: the drafter goes on as it was (extends)
                features = [TargetFeatures(self._no_hidden(len(self.target.aux_layer_ids)), self._no_hidden(1))
                            for _ in call.seqs]
        return features

    def _no_hidden(self, layers: int) -> torch.Tensor:
        return torch.zeros(0, layers * self.target.hidden_size, device=self.target.device)

    def _end(self, call: Call) -> None:
        done = all(s.finish_reason is not None for s in call.seqs)
        for rid in call.started:
            (call.proposer.finish_request if done else call.proposer.abort_request)(rid)
        call.started = []
        call.stats.calls += 1
        call.stats.total_s += time.perf_counter() - call.start
        self.stats.add(call.stats)

    # ------------------------------------------------------------------------------------------------ the loop

    def _decode_step(self, calls: list[Call]) -> None:
        """One decode step of every live sequence of `calls`: propose -> route -> verify (one pass of the target over
        all of them) -> update. A call still running its prompt (a chunk per step, `_prompt_chunk`) only runs its
        chunk in that pass, after taking what other calls ran of the same tokens (`_share_prompt`). A call whose
        proposer or update fails gets the error (its thread raises it); the others go on."""
        waiting = []  # calls that copy their next prompt positions from an earlier call's pass, after it
        for call in calls:
            if call.deferred_prefill is not None:
                with failing(call):
                    if self._share_prompt(call, calls):
                        waiting.append(call)
        calls = [c for c in calls if c.error is None and not any(c is w for w in waiting)]
        chunks = {id(c): self._prompt_chunk(c) for c in calls}
        proposed = self._propose([c for c in calls if not chunks[id(c)].prefill_only])
        routed: dict[int, list[Proposal]] = {}
        for call in calls:
            if id(call) in proposed:
                with call.stats.timed("propose_s"), failing(call):
                    routed[id(call)] = self._route(call, proposed[id(call)])
        calls = [c for c in calls if c.error is None]
        if not calls:
            return
        try:
            verified = self._verify(calls, [routed.get(id(c)) for c in calls], [chunks[id(c)] for c in calls])
        except Exception as e:
            for call in calls:
                call.error, call.live = e, []
            return
        for call, (out, results) in zip(calls, verified):
            if call.features_wanted is not None and call.deferred_prefill is None:  # its prompt has run
                with failing(call):
                    self._hand_prompt_features(call)
            if results is None or call.error is not None:  # a prompt chunk alone: nothing to commit yet
                continue
            with call.stats.timed("update_s"), failing(call):
                self._update(call, proposed[id(call)], routed[id(call)], out, results)
            if not call.stats.first_token_s and call.stats.new_tokens:
                call.stats.first_token_s = time.perf_counter() - call.start

    def _share_prompt(self, call: Call, stepping: list[Call]) -> bool:
        """In-flight prefix sharing: the positions of `call`'s deferred prompt that another running call has run
        already (the same tokens from the first one on: agents of one framework share its long system prompt) are
        copied from that call's cache instead of run again. Returns True when a call begun earlier runs the position
        `call` would run next in this step's pass: `call` then waits a step and copies it after. A proposer that
        reads the prompt's last features keeps those positions to run (their features come from its passes)."""
        prompt, done = call.seqs[0].tokens, call.cache.lengths[0]
        limit = len(prompt) - 1 - (call.features_wanted or 0)  # positions that may come from elsewhere
        if limit <= done:
            return False
        mine = np.asarray(prompt[:limit], dtype=np.int64)
        best, source, wait = done, None, False
        for other in self._live:
            if other is call or other.cache is None or other.cache.batch_size != 1:
                continue
            shared = common_prefix(np.asarray(other.seqs[0].tokens, dtype=np.int64), mine)
            if min(shared, other.cache.lengths[0]) > best:
                best, source = min(shared, other.cache.lengths[0]), other
            # a call begun earlier whose chunk of this pass runs position `done`, which `call` shares with it
            ahead = other.cache.lengths[0] <= done < min(shared, other.cache.lengths[0] + self.prefill_chunk)
            wait = wait or (ahead and other.deferred_prefill is not None and any(other is c for c in stepping)
                            and self._live.index(other) < self._live.index(call))
        if source is not None:
            call.cache.copy_prefix(0, source.cache, 0, best, start=done)
            call.deferred_prefill = prompt[best:-1] or None
            call.stats.prefill_tokens -= best - done
            return self._share_prompt(call, stepping)  # a copy from one may leave positions another runs
        return wait

    def _prompt_chunk(self, call: Call) -> "_PromptChunk":
        """The deferred prompt tokens `call` runs in this step's pass: all that are left, with its first step, when
        they fit in one step's share (`prefill_chunk`; with a draft tree no more than the target's
        tree_prompt_chunk); otherwise a chunk of that share alone. Also alone, a prompt runs in chunks: a call that
        arrives meanwhile joins at the next chunk rather than after the whole prompt."""
        pending = call.deferred_prefill
        if pending is None:
            return _PromptChunk([], prefill_only=False)
        share = self.prefill_chunk
        if len(pending) <= (min(share, self.target.tree_prompt_chunk) if call.params.tree else share):
            return _PromptChunk(pending, prefill_only=False)
        return _PromptChunk(pending[:share], prefill_only=True)

    def _hand_prompt_features(self, call: Call) -> None:
        """A late-features proposer gets the target's features at the prompt's last positions, which the passes of
        its deferred prompt gathered, before its first step's tokens."""
        aux, final = (torch.cat(parts) for parts in zip(*call.prompt_features))
        call.features_wanted, call.prompt_features = None, []
        call.proposer.prompt_features(call.seqs[0].request_id, TargetFeatures(aux, final))

    def _propose(self, calls: list[Call]) -> dict[int, list[Proposal]]:
        """Each live sequence's draft (by id(call)): no longer than the budget, the context left, or the tokens still
        wanted. A proposer drafts the sequences of every greedy call it serves in this step together
        (`speculate_each`: a drafter's one pass for all of them); a sampling call's alone, with its own generator.
        A call whose proposer fails gets the error."""
        groups: dict[Any, list[Call]] = {}
        for call in calls:
            key = (id(call.proposer), call.params.tree) if call.params.temperature == 0 else id(call)
            groups.setdefault(key, []).append(call)
        proposed: dict[int, list[Proposal]] = {}
        for group in groups.values():
            start = time.perf_counter()
            rows = [(call, i) for call in group for i in call.live]
            budgets = [draft_budget(call.params.num_speculative_tokens, len(call.seqs[i].tokens),
                                    len(call.seqs[i].generated), call.rules) for call, i in rows]
            asked = [r for r, budget in enumerate(budgets) if group[0].proposer is not None and budget > 0]
            drafts = [Proposal.empty() for _ in rows]
            try:
                group[0].set_sampling()  # the proposer may serve other calls' sequences with other settings
                made = speculate_each(group[0].proposer, [rows[r][0].seqs[rows[r][1]].request_id for r in asked],
                                      [budgets[r] for r in asked], tree=group[0].params.tree) if asked else []
                for r, proposal in zip(asked, made):
                    if len(proposal) > budgets[r]:
                        raise ValueError(f"{type(group[0].proposer).__name__} proposed {len(proposal)} tokens; at "
                                         f"most {budgets[r]} were asked for")
                    drafts[r] = proposal
            except Exception as e:
                for call in group:
                    call.error, call.live = e, []
                continue
            for call in group:
                proposed[id(call)] = [d for (owner, _), d in zip(rows, drafts) if owner is call]
                call.stats.propose_s += time.perf_counter() - start
        return proposed

    def _route(self, call: Call, proposals: list[Proposal]) -> list[Proposal]:
        """The part of each draft worth a verification pass (the router's cost gate)."""
        routed = self.router(proposals, [len(call.seqs[i].tokens) for i in call.live])
        if len(routed) != len(proposals):
            raise ValueError(f"the router returned {len(routed)} proposals for {len(proposals)} sequences")
        if call.params.temperature > 0:
            # A sampled draft is verified as drawn: cutting it by its own tokens' probabilities would make the kept
            # tokens no longer follow the draft distribution the rejection rule assumes, and bias the output.
            routed = [p if p.draft_logits is not None else r for p, r in zip(proposals, routed)]
        call.stats.proposals += sum(1 for p in proposals if len(p))
        call.stats.skipped_proposals += sum(1 for p, r in zip(proposals, routed) if len(p) and not len(r))
        return routed

    def _verify(self, calls: list[Call], routed: list[list[Proposal] | None], chunks: list["_PromptChunk"]
                ) -> list[tuple[StepOutput, list[VerifyResult] | None]]:
        """One pass of the target over [last token] + draft for every live sequence of every call, and the prompt
        chunks of the calls still prefilling (`_prompt_chunk`); then each call's acceptance rule (None for a chunk
        alone).

        Greedy: a draft token is kept while it equals the target's argmax; sampling: x is kept with probability
        min(1, p_target(x) / p_draft(x)), else the target resamples from norm(max(0, p_target - p_draft))."""
        inputs = []
        for c, rs, chunk in zip(calls, routed, chunks):
            # the chunk's tokens among the prompt's last features_wanted
            tail = 0 if c.features_wanted is None else max(
                0, len(chunk.tokens) - max(0, len(c.deferred_prefill or ()) - c.features_wanted))
            if chunk.prefill_only:
                inputs.append(StepInput(c.cache, [], prompt=chunk.tokens, prompt_tail=tail))
            else:
                inputs.append(StepInput(c.cache, [c.seqs[i].tokens[-1] for i in c.live], [r.token_ids for r in rs],
                                        [r.parents for r in rs], prompt=chunk.tokens, prompt_tail=tail))
            if chunk.tokens:
                c.deferred_prefill = c.deferred_prefill[len(chunk.tokens):] or None
        stepping = [c for c, chunk in zip(calls, chunks) if not chunk.prefill_only]
        start = time.perf_counter()
        outs = self.target.step_many(inputs, return_hidden=any(c.wants_target_features for c in calls),
                                     argmax_only=all(c.params.temperature == 0 for c in stepping))
        elapsed = time.perf_counter() - start
        verified = []
        for c, rs, chunk, out, step_input in zip(calls, routed, chunks, outs, inputs):
            if step_input.prompt_tail:
                c.prompt_features.append(out.hidden_tail[0])
            if chunk.tokens:  # a pass that ran the call's prompt tokens is its prefill (its first step included)
                c.stats.prefill_s += elapsed
            else:
                c.stats.verify_s += elapsed
            if chunk.prefill_only:
                verified.append((out, None))
                continue
            with c.stats.timed("verify_s"):
                verified.append((out, verify_batch(out.logits, rs, c.params.temperature, c.params.top_k,
                                                   c.params.top_p, c.params.generator)))
        return verified

    def _update(self, call: Call, proposed: list[Proposal], routed: list[Proposal], out: StepOutput,
                results: list[VerifyResult]) -> None:
        """Commit each sequence's accepted tokens: the KV cache, the stop rules, the proposer, the statistics; then
        retire the sequences that finished."""
        self.router.observe(routed, [r.accepted for r in results])
        finished = []
        for row, (i, proposal, result) in enumerate(zip(call.live, routed, results)):
            seq = call.seqs[i]
            kept_slots = [0] + [1 + a for a in result.accepted]  # the step's input slot and the accepted path
            call.cache.commit(row, kept_slots)
            committed = self._commit(seq, result.tokens(proposal), call)
            call.cache.truncate(row, len(seq.tokens) - 1)  # a stop inside the committed tokens drops the rest
            call.feed_proposer(row, seq, committed, out, kept_slots)
            source = (proposed[row].source or "unnamed") if len(proposed[row]) else None
            call.stats.count_step(source, len(proposal), len(result.accepted), len(committed),
                                  proposed[row].drafter_ran)
            if seq.finish_reason is not None:
                finished.append(row)
        self._retire(call, finished)

    def _commit(self, seq: SequenceState, tokens: list[int], call: Call) -> list[int]:
        """Append verified tokens up to the stop rules (`hybridspec.runtime.commit`) and a stop string; returns those kept."""
        kept, reason = commit_tokens(tokens, len(seq.generated), len(seq.tokens), call.rules)
        cut = stop_cut(self._decode, seq.generated, kept, call.params.stop)
        if cut is not None:
            kept, reason = kept[:cut], "stop"
        seq.tokens += kept
        seq.finish_reason = reason
        return kept

    def _retire(self, call: Call, finished_rows: list[int]) -> None:
        """Finished sequences leave the batch; the prefix cache keeps their KV (a one-row cache as it is, others
        copied out)."""
        if not finished_rows:
            return
        if self.prefix_cache is not None:
            for row in finished_rows:
                seq = call.seqs[call.live[row]]
                cache = call.cache if call.cache.batch_size == 1 else call.cache.row(row)
                self.prefix_cache.store(seq.request_id, seq.tokens, cache,
                                        id(call.proposer) if call.proposer is not None else None)
        keep = [r for r in range(len(call.live)) if r not in finished_rows]
        if keep:
            call.cache.select_rows(keep)
        call.live = [call.live[r] for r in keep]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@dataclass
class _PromptChunk:
    """A call's deferred prompt tokens run in one step's pass; prefill_only: they are not all of them, so the call's
    first step waits for a later pass."""

    tokens: list[int]
    prefill_only: bool
