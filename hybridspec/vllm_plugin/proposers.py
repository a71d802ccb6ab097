"""The proposers `vllm_plugin` puts in vLLM's place, as subclasses of the classes they replace (vLLM's runner checks
its drafter with isinstance). Imported only by the plugin's patches, in a process that has vLLM."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

from hybridspec.proposal import Proposal
from hybridspec.router import CostGate, choose_draft
from hybridspec.vllm_plugin.config import ENV_SWITCH, HYBRID_METHODS, PluginError, announce
from hybridspec.vllm_plugin.fasteagle import ARCHITECTURE as FASTEAGLE_ARCHITECTURE
from hybridspec.vllm_plugin.requests import new_requests


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
        drafts = []
        for i, budget in enumerate(budgets):
            rid = input_batch.req_ids[i]
            drafts.append(requests.route(rid, requests.speculate(rid, budget), requests.contexts[i])
                          if budget > 0 else [])
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass  # no model


def _first_tensor_parallel_rank() -> bool:
    from vllm.distributed import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return not model_parallel_is_initialized() or get_tensor_model_parallel_rank() == 0


class HybridspecHybridProposer(EagleProposer):
    """vLLM's EAGLE proposer (P-EAGLE with parallel drafting, or EAGLE-3) drafting every row, so its KV cache stays
    in step; per row the engine's hybrid rule (`choose_draft`) keeps its draft or the suffix cache's.

    vLLM's EAGLE draft carries no probabilities: it enters the rule as a chain of probability-1 tokens, and the
    rule's expectation is the engine's calibrated one (`CostGate.expected_tokens`), which learns each source's
    acceptance online from what vLLM accepted of the previous step's draft. Drafts are returned as lists of their
    own lengths (vLLM's EAGLE input preparation without the padded batch takes per-request draft lengths), so no
    padding is verified or counted.
    """

    def __init__(self, vllm_config: Any, device: Any, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        spec = vllm_config.speculative_config
        if spec.method not in HYBRID_METHODS:
            raise PluginError(f"{ENV_SWITCH}=hybrid works with speculative methods {', '.join(HYBRID_METHODS)}; "
                              f"this config has method {spec.method!r}")
        self.hybridspec_requests = new_requests(vllm_config, hybrid=True)
        announce(spec.method, "hybridspec's suffix + EAGLE hybrid (the router's choice per row)")
        # the calibrated expectation the choice reads; it learns from every routed draft (observe), trims them
        # only where HYBRIDSPEC_VLLM_VERIFY_COST asks
        self.trims = self.hybridspec_requests.gate is not None
        if not self.trims:
            self.hybridspec_requests.gate = CostGate()
        self.gate = self.hybridspec_requests.gate
        architectures = getattr(spec.draft_model_config.hf_config, "architectures", None) or []
        self.drafter_source = ("fasteagle" if FASTEAGLE_ARCHITECTURE in architectures
                               else "peagle" if spec.parallel_drafting else spec.method)
        self.chosen: dict[str, int] = {"suffix": 0, self.drafter_source: 0}
        self._batch: Any = None
        self._requests: dict | None = None
        self._booked = True
        self._sampled: list[list[int]] | None = None

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
        eagle = super().propose(num_speculative_tokens, *args, **kwargs)
        if self._sampled is None:  # not via prepare_next_token_ids_cpu (a dummy run)
            return eagle
        batch, sampled, self._sampled = self._batch, self._sampled, None
        requests = self.hybridspec_requests
        budgets = requests.update(batch, sampled, self._requests, num_speculative_tokens, booked=self._booked)
        eagle_rows = eagle.tolist()
        drafts: list[list[int]] = []
        suffix_rows = []
        for i, budget in enumerate(budgets):
            rid = batch.req_ids[i]
            if budget <= 0:
                drafts.append([] if sampled[i] else eagle_rows[i])  # a partial prefill: vLLM drops it anyway
                continue
            drafted = Proposal.chain(eagle_rows[i][:budget], source=self.drafter_source)
            best = choose_draft(requests.speculate(rid, budget), drafted, self.gate.expected_tokens)
            self.chosen[best.source] = self.chosen.get(best.source, 0) + 1
            requests.event("chosen", rid, source=best.source, draft=list(best.token_ids))
            draft = requests.route(rid, best, requests.contexts[i], trim=self.trims)
            if best.source != self.drafter_source:
                suffix_rows.append((i, draft))
            drafts.append(draft)
        self._one_hot_draft_probs(suffix_rows)
        return drafts

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
