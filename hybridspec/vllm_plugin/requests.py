"""The request life cycle inside vLLM, shared by both proposers: a `SuffixCache` fed from vLLM's persistent batch the
way hybridspec's Engine feeds it (start, append the committed tokens, speculate, finish or abort)."""
from __future__ import annotations

import importlib
import os
import time
from typing import Any, Sequence

from hybridspec.runtime.commit import StopRules, commit_tokens, draft_budget
from hybridspec.vllm_plugin.config import ENV_OBSERVER, ENV_VERIFY_COST, PluginError

REFIT = 16  # passes learnt between two refits of the gate's tables
DECODE_ROW_TOKENS = 64  # a row scheduling more is a prompt chunk: its pass is not learnt from


class SuffixRequests:
    """Feeds a `SuffixCache` from vLLM's persistent batch the way hybridspec's Engine feeds it (module docstring).

    `started` holds the requests started on the cache; every one of them ends in finish_request or abort_request once
    vLLM drops it, so nothing leaks. `counters["drafts"]` / `["draft_tokens"]` count real drafts only (never padding).
    """

    def __init__(self, cache: Any, max_seq_len: int, observer: Any = None) -> None:
        self.cache = cache
        self.max_seq_len = max_seq_len
        self.started: set[str] = set()
        self.observer = observer
        self.runner_requests: dict | None = None  # the runner's request states (sampling params), set each step
        self._histories: dict[str, list[int]] = {}  # for the observer only
        self.contexts: list[int] = []  # per row of the last update: its tokens so far (the gate's context)
        self.gate = None  # a CostGate that trims drafts (HYBRIDSPEC_VLLM_VERIFY_COST), or None
        self._routed: dict[str, Any] = {}  # rid -> the Proposal vLLM verified last step (calibrates the gate)
        self.counters = dict(started=0, finished=0, aborted=0, drafts=0, draft_tokens=0)
        self.fit = None  # a PassCostFit refitting the gate to vLLM's passes (HYBRIDSPEC_VLLM_VERIFY_COST=measure)
        self._pass: tuple[list[int], list[int]] | None = None  # the running decode pass: rows' tokens and contexts
        self._pass_started = 0.0
        self.prompt_in_step = True  # the step scheduled prompt tokens (a chunk, a new or resumed request)

    def event(self, kind: str, rid: str | None, **fields: Any) -> None:
        if self.observer is not None:
            self.observer.event(kind, rid, **fields)

    def rules(self, params: Any) -> StopRules:
        """The engine's stop rules for a request with vLLM's sampling params (None: only the model's length)."""
        if params is None:
            return StopRules(frozenset(), None, self.max_seq_len)
        return StopRules(params.all_stop_token_ids, params.max_tokens, self.max_seq_len, params.min_tokens)

    # -- called by the runner's _update_states, before it drops finished requests
    def on_scheduler_output(self, scheduler_output: Any, requests: dict) -> None:
        if self.fit is not None:
            self._time_pass(scheduler_output)
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        self._keep_verified(scheduler_output, drafts)
        # a new request (even one whose whole prompt hit the prefix cache, scheduling its last token alone) or a row
        # scheduling more than its token and its drafts (a prompt chunk, a resumed request)
        self.prompt_in_step = bool(getattr(scheduler_output, "scheduled_new_reqs", None)) or any(
            n > 1 + len(drafts.get(rid, ())) for rid, n in scheduler_output.num_scheduled_tokens.items())
        for rid in list(scheduler_output.finished_req_ids):
            if rid in self.started:
                self._end(rid, self._finished_normally(requests.get(rid)))
        for rid in self.started & scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            self._end(rid, False)  # back from preemption: restarted on its next sampled token

    def _time_pass(self, scheduler_output: Any) -> None:
        """The time since the last pass began is that pass's cost (the runner's steps follow one another): the fit
        learns it, and every REFIT passes learnt the gate plans by the fit's tables. Only decode passes are learnt
        (no row with more than DECODE_ROW_TOKENS: a prompt chunk's tokens cost what the drafts' do not)."""
        now = time.perf_counter()
        if self._pass is not None and self.fit.observe(*self._pass, (now - self._pass_started) * 1e3) \
                and self.fit.passes % REFIT == 0:
            self.gate.set_costs(self.fit.verify_costs(), self.fit.pass_cost())
            self.event("refit", None, passes=self.fit.passes, ms=[round(float(v), 4) for v in self.fit.costs()])
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed.update((r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs)
        decode = scheduled and max(scheduled.values()) <= DECODE_ROW_TOKENS
        self._pass = ([int(n) for n in scheduled.values()], [int(computed.get(rid, 0)) for rid in scheduled]) \
            if decode else None
        self._pass_started = now

    def _keep_verified(self, scheduler_output: Any, scheduled: dict) -> None:
        """The gate learns from what vLLM verifies of a routed draft: the scheduler cuts a draft to the token budget
        and, under structured outputs, at the first token the grammar refuses (-1 from there, or a shorter list);
        the tokens cut were never verified, so they count as neither accepted nor rejected."""
        for rid in [r for r in self._routed if r in scheduler_output.num_scheduled_tokens]:
            tokens = scheduled.get(rid, ())
            verified = next((i for i, t in enumerate(tokens) if t < 0), len(tokens))
            if verified < len(self._routed[rid]):
                self.event("cut", rid, routed=len(self._routed[rid]), verified=verified)
                if verified == 0:
                    del self._routed[rid]
                else:
                    self._routed[rid] = self._routed[rid].subset(range(verified))

    def _finished_normally(self, state: Any) -> bool:
        """The engine's rules ended it with its last token (a stop token, max_tokens, the model's length); anything
        else (an abort, a stop string caught by the front end) is an abort for the cache."""
        if state is None or not state.output_token_ids or state.sampling_params is None:
            return False
        output = state.output_token_ids
        _, reason = commit_tokens(output[-1:], len(output) - 1, state.num_prompt_tokens + len(output) - 1,
                                  self.rules(state.sampling_params))
        return reason is not None

    def _end(self, rid: str, normally: bool) -> None:
        self.started.discard(rid)
        (self.cache.finish_request if normally else self.cache.abort_request)(rid)
        self.counters["finished" if normally else "aborted"] += 1
        self.event("finish" if normally else "abort", rid)

    # -- called by the proposers each step
    def update(self, input_batch: Any, sampled_token_ids: Sequence[Sequence[int]], requests: dict | None,
               num_speculative_tokens: int, booked: bool = True) -> list[int]:
        """Start, append, and end what left the batch; returns each row's draft budget (0: no draft for that row).
        booked: vLLM's bookkeeping already wrote this step's sampled tokens into the batch (False: a drafter that runs
        before it, as EAGLE with the padded drafter batch does)."""
        present = input_batch.req_id_to_index
        for rid in [r for r in self.started if r not in present]:  # preempted or unscheduled: left the batch
            self._end(rid, False)
        for rid in [r for r in self._routed if r not in self.started]:
            del self._routed[rid]
        budgets, self.contexts = [], []
        for i, sampled in enumerate(sampled_token_ids):
            rid = input_batch.req_ids[i]
            num_tokens = int(input_batch.num_tokens_no_spec[i]) + (0 if booked else len(sampled))
            self.contexts.append(num_tokens)
            if not sampled or rid is None:  # a partial prefill: nothing sampled yet
                budgets.append(0)
                continue
            num_prompt = int(input_batch.num_prompt_tokens[i])
            state = requests.get(rid) if requests is not None else None
            rules = self.rules(state.sampling_params if state is not None else None)
            before = num_tokens - len(sampled)
            tokens, reason = commit_tokens(list(sampled), before - num_prompt, before, rules)
            self.observe(rid, len(sampled))
            if rid not in self.started:
                history = input_batch.token_ids_cpu[i, :before]
                self.cache.start_request(rid, history[:num_prompt])
                if len(history) > num_prompt:  # a preempted request returning: its output so far
                    self.cache.append(rid, history[num_prompt:])
                self.started.add(rid)
                self.counters["started"] += 1
                self.event("start", rid, prompt=[int(t) for t in history[:num_prompt]],
                           output=[int(t) for t in history[num_prompt:]])
            self.cache.append(rid, tokens)
            self.event("append", rid, tokens=tokens)
            # vLLM's num_tokens counts the sampled token that is not in its KV yet: one slot more than the engine's
            budgets.append(0 if reason is not None else
                           draft_budget(num_speculative_tokens, num_tokens + 1, num_tokens - num_prompt, rules))
            if self.observer is not None:  # the token history as vLLM holds it, for the replay in the tests
                self._histories[rid] = [int(t) for t in input_batch.token_ids_cpu[i, :before]] + [int(t) for t in
                                                                                                   sampled]
        return budgets

    def speculate(self, rid: str, budget: int) -> Any:
        proposal = self.cache.speculate(rid, budget)
        self.event("speculate", rid, budget=budget, draft=list(proposal.token_ids),
                   history=self._histories.pop(rid, None))
        return proposal

    def observe(self, rid: str, num_sampled: int) -> None:
        """What vLLM accepted of the request's previous draft (all sampled tokens but the target's own) teaches the
        gate each source's acceptance, as the engine's router.observe does."""
        previous = self._routed.pop(rid, None)
        if self.gate is not None and previous is not None and num_sampled and len(previous):
            self.gate.observe([previous], [list(range(min(num_sampled - 1, len(previous))))])

    def plan(self, proposals: Sequence[Any], trim: bool = True) -> list[Any]:
        """The part of each row's proposal (one per row of the last `update`; None or empty: no draft) worth
        verifying: the step's rows planned together by the gate where there is one (and `trim`), as the engine's
        router plans a step, so that under load few draft tokens or none are verified; else every proposal whole."""
        rows = [i for i, p in enumerate(proposals) if p is not None]
        if self.gate is None or not trim or not any(len(proposals[i]) for i in rows):
            return list(proposals)
        route = self.gate.plan([proposals[i] for i in rows], [self.contexts[i] for i in rows])
        planned = list(proposals)
        for i, keep in zip(rows, route.keep):
            planned[i] = proposals[i].subset(keep)
        return planned

    def book(self, rid: str, proposal: Any) -> list[int]:
        """The draft vLLM verifies for `rid` (as planned): counted, and kept for the gate to learn from next step."""
        if self.gate is not None:
            self.event("routed", rid, draft=list(proposal.token_ids))
            if len(proposal):
                self._routed[rid] = proposal
        if len(proposal):
            self.counters["drafts"] += 1
            self.counters["draft_tokens"] += len(proposal)
        return list(proposal.token_ids)


def suffix_cache_options(speculative_config: Any, vocab_size: int | None) -> dict:
    """The SuffixCache our proposers build from vLLM's suffix keys (the same for the replay in the tests). Finished
    requests are not retained: vLLM never continues one (`extends=`), so retaining would only hold memory."""
    return dict(max_depth=int(speculative_config.suffix_decoding_max_tree_depth),
                num_speculative_tokens=int(speculative_config.num_speculative_tokens),
                max_spec_factor=float(speculative_config.suffix_decoding_max_spec_factor),
                min_token_prob=float(speculative_config.suffix_decoding_min_token_prob),
                vocab_size=vocab_size, max_retained=0)


def new_requests(vllm_config: Any, *, hybrid: bool) -> SuffixRequests:
    """The SuffixRequests of one proposer: its suffix cache from vLLM's config, the optional gate and observer."""
    from hybridspec.suffix import SuffixCache

    options = suffix_cache_options(vllm_config.speculative_config, vllm_config.model_config.get_vocab_size())
    observer = None
    spec = os.environ.get(ENV_OBSERVER, "").strip()
    if spec:
        module, _, name = spec.partition(":")
        observer = getattr(importlib.import_module(module), name)(dict(options, hybrid=hybrid))
    requests = SuffixRequests(SuffixCache(**options), vllm_config.model_config.max_model_len, observer)
    cost = os.environ.get(ENV_VERIFY_COST, "").strip()
    if cost:
        from hybridspec.router import CostGate

        try:
            requests.gate = CostGate(None if cost in ("default", "measure") else cost)
        except ValueError as e:
            raise PluginError(f"{ENV_VERIFY_COST}={cost!r}: {e} (give \"measure\", \"default\" or the JSON "
                              f"written by benchmarks/bench_verify_cost.py)") from None
        if cost == "measure":
            from hybridspec.router.measured import PassCostFit

            requests.fit = PassCostFit(requests.gate.pass_cost)
    return requests
