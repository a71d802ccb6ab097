"""The proposers `vllm_plugin` puts in vLLM's place, as subclasses of the classes they replace (vLLM's runner checks
its drafter with isinstance). Imported only by the plugin's patches, in a process that has vLLM."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable

import torch
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

from hybridspec.proposal import Proposal
from hybridspec.router import CostGate, choose_draft, drafter_step_pays, positional_chain
from hybridspec.vllm_plugin.config import ENV_SWITCH, HYBRID_METHODS, PluginError, announce
from hybridspec.vllm_plugin.fasteagle import ARCHITECTURE as FASTEAGLE_ARCHITECTURE
from hybridspec.vllm_plugin.requests import new_requests

SHARE_DECAY = 0.8  # of the drafter's measured share of a step: a few steps follow a change of load


class HybridspecSuffixProposer(SuffixDecodingProposer):
    """vLLM's `method: "suffix"` served by hybridspec's SuffixCache (drafts of varying length, as vLLM's)."""

    def __init__(self, vllm_config: Any) -> None:  # not super().__init__: it imports ArcticInference
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        # With tensor parallelism every rank has a runner and a drafter, but vLLM schedules the drafts of the first
        # rank only: the others draft nothing and keep no suffix cache (the proposer runs once per step).
        drafts = _first_tensor_parallel_rank()
        self.hybridspec_requests = new_requests(vllm_config, hybrid=False) if drafts else None
        if drafts:
            announce("suffix", "hybridspec's SuffixCache")

    def propose(self, num_speculative_tokens: int, input_batch: Any, sampled_token_ids: list[list[int]],
                slot_mappings: Any = None) -> list[list[int]]:
        requests = self.hybridspec_requests
        if requests is None:
            return [[] for _ in sampled_token_ids]
        budgets = requests.update(input_batch, sampled_token_ids, requests.runner_requests,
                                  num_speculative_tokens)
        rids = input_batch.req_ids
        planned = requests.plan([requests.speculate(rids[i], budget) if budget > 0 else None
                                 for i, budget in enumerate(budgets)])
        return [requests.book(rids[i], draft) if draft is not None else [] for i, draft in enumerate(planned)]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass  # no model


def _first_tensor_parallel_rank() -> bool:
    from vllm.distributed import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return not model_parallel_is_initialized() or get_tensor_model_parallel_rank() == 0


def _first_ranks_plan(plan: dict[int, int] | None, first: bool = True) -> dict[int, int] | None:
    """The first tensor-parallel rank's plan (row -> drafter tokens verified; None: the drafter idles this step) on
    every rank (`first`: this is that rank): the drafter's pass is sharded, so all ranks run the same slots and logit
    rows, or none."""
    from vllm.distributed import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return plan
    return get_tp_group().broadcast_object((plan,) if first else None, src=0)[0]


class HybridspecHybridProposer(EagleProposer):
    """vLLM's EAGLE proposer (P-EAGLE with parallel drafting, or EAGLE-3) beside our suffix cache: per row the
    engine's hybrid rule (`choose_draft`) takes the drafter's draft or the suffix cache's.

    vLLM's EAGLE draft carries no probabilities: it enters the rule as a chain rated by position alone
    (`router.positional_chain`), so the calibrated `CostGate.expected_tokens`, learnt online from what vLLM accepted
    of the previous steps' drafts, knows the acceptance at each draft position. Each row's source, and with the gate
    the prefix of each draft worth verifying, is decided before the drafter runs; the drafter then runs P-EAGLE's
    parallel slots (or EAGLE-3's passes) for the longest draft verified only, and computes its logits (over the
    vocabulary) only at the positions vLLM will verify. In a step where no row verifies a drafter token (the suffix
    drafts win, or the gate plans them out) the drafter idles: its pass over the step's tokens cost 6% of a 16-agent
    CPU step for nothing drafted. It idles too where its drafts are not expected to pay for its pass
    (`router.drafter_step_pays`, by its share of a decode step as timed here, `_time_step`). Its KV cache then lacks
    those positions, which later drafts attend to as they find them (a worse draft at most: every draft is
    verified); a step with prompt tokens runs it on them all the same (with a whole prompt missing it would have
    nothing to draft from). Unlike the engine's drafter, vLLM's cannot catch up later: the target's features of a
    step are gone by the next.

    Under tensor parallelism the first rank alone routes (vLLM verifies its drafts) and every rank runs its shard of
    the drafter as that rank planned (`_first_ranks_plan`). Drafts are returned as lists of their own lengths (vLLM's
    EAGLE input preparation without the padded batch takes per-request draft lengths), so no padding is verified or
    counted.
    """

    def __init__(self, vllm_config: Any, device: Any, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        spec = vllm_config.speculative_config
        if spec.method not in HYBRID_METHODS:
            raise PluginError(f"{ENV_SWITCH}=hybrid works with speculative methods {', '.join(HYBRID_METHODS)}; "
                              f"this config has method {spec.method!r}")
        # Under tensor parallelism every rank runs its shard of the drafter, but the first alone routes (vLLM
        # verifies its drafts): the others keep no suffix cache and draft as it planned (`_first_ranks_plan`).
        self.hybridspec_requests = new_requests(vllm_config, hybrid=True) if _first_tensor_parallel_rank() else None
        self.trims = False
        if self.hybridspec_requests is not None:
            announce(spec.method, "hybridspec's suffix + EAGLE hybrid (the router's choice per row)")
            # the calibrated expectation the choice reads; it learns from every routed draft (observe), trims them
            # only where HYBRIDSPEC_VLLM_VERIFY_COST asks
            self.trims = self.hybridspec_requests.gate is not None
            if not self.trims:
                self.hybridspec_requests.gate = CostGate()
        architectures = getattr(spec.draft_model_config.hf_config, "architectures", None) or []
        self.drafter_source = ("fasteagle" if FASTEAGLE_ARCHITECTURE in architectures
                               else "peagle" if spec.parallel_drafting else spec.method)
        self.chosen: dict[str, int] = {"suffix": 0, self.drafter_source: 0}
        # steps of this rank's drafter; declined: idle because its pass was not expected to pay (drafter_step_pays)
        self.drafter_steps = {"ran": 0, "idle": 0, "declined": 0}
        self.drafter_share: float | None = None  # its pass over the rest of a decode step (_time_step)
        self._drafter_ms: float | None = None  # its pass in the running step, where that was a decode step's
        self._step_started: float | None = None
        self._batch: Any = None
        self._requests: dict | None = None
        self._booked = True
        self._sampled: list[list[int]] | None = None
        self._wanted: dict[int, int] | None = None  # during propose: row -> drafter tokens verified (see _logit_rows)
        self._draft_pass = 0  # the drafter's sampling calls in this propose (EAGLE-3 samples once per position)

    # The runner hands the step's sampled tokens to one of these two before propose(): the lists after its
    # bookkeeping (disable_padded_drafter_batch, EAGLE-3), or the padded tensor before it (parallel drafting).
    def prepare_next_token_ids_cpu(self, sampled_token_ids: list[list[int]], requests: dict, gpu_input_batch: Any,
                                   num_scheduled_tokens: dict) -> Any:
        self._batch, self._sampled, self._requests, self._booked = (gpu_input_batch, sampled_token_ids, requests,
                                                                    True)
        return super().prepare_next_token_ids_cpu(sampled_token_ids, requests, gpu_input_batch,
                                                  num_scheduled_tokens)

    def prepare_next_token_ids_padded(self, sampled_token_ids: Any, requests: dict, gpu_input_batch: Any,
                                      discard_request_mask: Any) -> Any:
        num_reqs = gpu_input_batch.num_reqs
        rows = sampled_token_ids[:num_reqs].tolist()  # rejected slots hold -1; one copy per step on a GPU
        discard = discard_request_mask[:num_reqs].tolist()
        self._sampled = [[] if discard[i] else [t for t in row if t >= 0] for i, row in enumerate(rows)]
        self._batch, self._requests, self._booked = gpu_input_batch, requests, False
        return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                     discard_request_mask)

    def propose(self, num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if self._sampled is None:  # not via prepare_next_token_ids_* (a dummy run)
            return super().propose(num_speculative_tokens, *args, **kwargs)
        batch, sampled, self._sampled = self._batch, self._sampled, None
        requests = self.hybridspec_requests
        if requests is None:  # a later tensor-parallel rank: its shard of the first rank's drafter pass
            return self._draft_as_planned(_first_ranks_plan(None, first=False), *args, **kwargs)
        self._time_step()
        budgets = requests.update(batch, sampled, self._requests, num_speculative_tokens, booked=self._booked)
        rids = batch.req_ids
        chosen: list[Proposal | None] = []
        suffixes: list[Proposal | None] = []
        for i, budget in enumerate(budgets):
            if budget <= 0:
                chosen.append(None)
                suffixes.append(None)
                continue
            # the drafter's draft as the rule sees it before it runs: its length, source and positions
            drafter = positional_chain([0] * min(budget, num_speculative_tokens), self.drafter_source)
            suffixes.append(requests.speculate(rids[i], budget))
            chosen.append(choose_draft(suffixes[-1], drafter, requests.gate.expected_tokens))
        planned = requests.plan(chosen, trim=self.trims)
        wanted = {i: len(p) for i, p in enumerate(planned)
                  if p is not None and p.source == self.drafter_source and len(p)}
        if wanted and not requests.prompt_in_step:  # with prompt tokens it runs anyway: its drafts come free
            suffix_plan = requests.plan(suffixes, trim=self.trims)
            if not drafter_step_pays(requests.gate, planned, suffix_plan, requests.contexts, self.drafter_share):
                chosen, planned, wanted = suffixes, suffix_plan, {}
                self.drafter_steps["declined"] += 1
                requests.event("declined", None, share=self.drafter_share)
        # no drafter token verified and no prompt to build its KV for: the drafter idles (see the class docstring)
        idle = not wanted and not requests.prompt_in_step
        eagle_rows = self._draft_as_planned(_first_ranks_plan(None if idle else wanted), *args, **kwargs)
        drafts: list[list[int]] = []
        suffix_rows = []
        for i, draft in enumerate(planned):
            if draft is None:
                drafts.append([] if sampled[i] else eagle_rows[i])  # a partial prefill: vLLM drops it anyway
                continue
            rid = batch.req_ids[i]
            source = chosen[i].source
            self.chosen[source] = self.chosen.get(source, 0) + 1
            if draft.source == self.drafter_source:
                draft = positional_chain(eagle_rows[i][:len(draft)], self.drafter_source)
            requests.event("chosen", rid, source=source, draft=list(draft.token_ids))
            drafts.append(requests.book(rid, draft))
            if source != self.drafter_source:
                suffix_rows.append((i, drafts[-1]))
        self._one_hot_draft_probs(suffix_rows)
        return drafts

    def _draft_as_planned(self, wanted: dict[int, int] | None, *args: Any, **kwargs: Any) -> list[list[int]]:
        """The drafter's pass for a plan (row -> drafter tokens verified): its logits at those positions only. None:
        the drafter idles, no draft and no draft probabilities (vLLM verifies the suffix drafts as deterministic)."""
        self.drafter_steps["ran" if wanted is not None else "idle"] += 1
        if wanted is None:
            self._last_draft_probs = None
            if self.hybridspec_requests is not None:
                self.hybridspec_requests.event("drafter", None, positions=None)
            return [[] for _ in range(kwargs["common_attn_metadata"].batch_size())]
        self._wanted, self._draft_pass = wanted, 0
        started = time.perf_counter()
        try:
            drafts = self._run_drafter(max(wanted.values(), default=0), *args, **kwargs).tolist()  # synchronises
        finally:
            self._wanted = None
        if wanted and self.hybridspec_requests is not None and not self.hybridspec_requests.prompt_in_step:
            self._drafter_ms = (time.perf_counter() - started) * 1e3  # a decode step's pass: the share learns it
        return drafts

    def _time_step(self) -> None:
        """The drafter's share of a decode step, learnt from the steps it ran in: its pass's ms over the rest of
        the step (from one propose to the next, the target's pass among it), a moving average."""
        now = time.perf_counter()
        if self._drafter_ms is not None and self._step_started is not None:
            rest = (now - self._step_started) * 1e3 - self._drafter_ms
            if rest > 0:
                share = self._drafter_ms / rest
                self.drafter_share = share if self.drafter_share is None else \
                    SHARE_DECAY * self.drafter_share + (1 - SHARE_DECAY) * share
        self._step_started, self._drafter_ms = now, None

    def _run_drafter(self, n: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        """vLLM's drafter pass for the step, drafting n positions (the longest draft verified): P-EAGLE with n - 1
        parallel slots a row instead of K - 1, EAGLE-3 with n passes instead of K. The drafts at those positions are
        the same as with K (the slots come after them and attention is causal). n = 0 (a step with prompt tokens and
        no drafter token verified): the drafter's layers run on the step's tokens alone, so its KV cache holds the
        prompt, as vLLM's EAGLE path does for a step of no drafts; nothing is sampled. Returns [rows, n] draft
        tokens; kept draft probabilities are padded to K positions."""
        k = self.num_speculative_tokens
        kept = (self.extra_slots_per_request, self.net_num_new_slots_per_request, self.needs_extra_input_slots)
        if self.parallel_drafting and n < k:
            fewer = k - max(n, 1)
            self.extra_slots_per_request -= fewer
            self.net_num_new_slots_per_request -= fewer
            self.needs_extra_input_slots = self.net_num_new_slots_per_request > 0
        if self.hybridspec_requests is not None:
            self.hybridspec_requests.event("drafter", None, positions=n)
        try:
            drafts = super().propose(n, *args, **kwargs)
        finally:
            self.num_speculative_tokens = k
            self.extra_slots_per_request, self.net_num_new_slots_per_request, self.needs_extra_input_slots = kept
        probs = self._last_draft_probs
        if probs is not None and probs.shape[1] < k:  # suffix rows' one-hot probabilities may reach position K
            self._last_draft_probs = torch.cat([probs, probs.new_zeros((probs.shape[0], k - probs.shape[1],
                                                                        probs.shape[2]))], dim=1)
        return drafts

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> Any:
        """vLLM's draft sampling, at the rows of `hidden_states` whose tokens are verified (`_logit_rows`); the other
        rows get token 0 and, where vLLM keeps draft probabilities, zeros (no row of theirs is read)."""
        num_rows, temperature = hidden_states.shape[0], sampling_metadata.temperature
        rows = self._logit_rows(num_rows)
        self._draft_pass += 1
        if temperature is not None and num_rows % temperature.shape[0]:
            rows = None  # not one temperature per request: leave the sampling to vLLM
        if self._wanted is not None and self.hybridspec_requests is not None:  # rows computed, of vLLM's
            self.hybridspec_requests.event("drafter_logits", None, rows=num_rows if rows is None else len(rows),
                                           of=num_rows)
        if rows is None or len(rows) == num_rows:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        keeps_probs = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        tokens = torch.zeros(num_rows, dtype=torch.int64, device=hidden_states.device)
        if not rows and not keeps_probs:
            return tokens, None
        # probabilities need one row computed to give the full tensor its vocabulary's size
        index = torch.tensor(rows or [0], dtype=torch.long, device=hidden_states.device)
        if temperature is not None:  # per request: per row of hidden_states, then the rows computed
            per_row = temperature.repeat_interleave(num_rows // temperature.shape[0], dim=0)
            sampling_metadata = dataclasses.replace(sampling_metadata, temperature=per_row[index])
        drawn, probs = super()._sample_draft_tokens(hidden_states[index], sampling_metadata)
        if rows:
            tokens[index] = drawn
        if probs is None:
            return tokens, None
        full = probs.new_zeros((num_rows, probs.shape[-1]))
        if rows:
            full[index] = probs
        return tokens, full

    def _logit_rows(self, num_rows: int) -> list[int] | None:
        """The rows of this sampling call whose tokens vLLM verifies (None: all, or a call outside propose). P-EAGLE
        samples once, row r * K + j for request r's position j; EAGLE-3 once per position, row r for request r."""
        wanted = self._wanted
        if wanted is None:
            return None
        k = self.num_speculative_tokens
        if self.parallel_drafting and num_rows % k == 0:
            return [r * k + j for r, n in wanted.items() if r < num_rows // k for j in range(min(n, k))]
        if not self.parallel_drafting:
            return [r for r, n in wanted.items() if r < num_rows and n > self._draft_pass]
        return None

    def _one_hot_draft_probs(self, rows: Iterable[tuple[int, list[int]]]) -> None:
        """Where vLLM keeps EAGLE's draft probabilities (sampling), a suffix row gets its own, one-hot: a
        deterministic proposer's distribution, so the rejection sampler stays lossless."""
        probs = self._last_draft_probs
        if probs is None:
            return
        for i, tokens in rows:
            probs[i].zero_()
            n = min(len(tokens), probs.shape[1])
            positions = torch.arange(n, device=probs.device)
            probs[i, positions, torch.tensor(tokens[:n], dtype=torch.long, device=probs.device)] = 1.0
