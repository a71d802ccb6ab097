"""hybridspec inside vLLM: our suffix cache as vLLM's `method: "suffix"`, and the suffix + P-EAGLE hybrid as its
`method: "eagle3"` (or `"eagle"`), switched on by one environment variable.

    HYBRIDSPEC_VLLM=suffix         vLLM's "suffix" method drafts from hybridspec's SuffixCache (no ArcticInference)
    HYBRIDSPEC_VLLM=hybrid         vLLM's "eagle3"/"eagle" method: the EAGLE head drafts every row, and per row the
                                   router (router/hybrid.py `choose_draft`, the engine's rule) keeps it or the
                                   suffix draft
    HYBRIDSPEC_VLLM=suffix,hybrid  both
    unset, "" or "0"               the plugin does nothing: installing hybridspec changes no vLLM that did not ask

vLLM loads `register()` (the `vllm.general_plugins` entry point) in every process: the front end, the engine core and
each worker; the variable is inherited by spawned workers. vLLM 0.32 has no proposer registry and its `custom_class`
method sees no request ids and no hidden states, so `register()` replaces two module globals of
`vllm.v1.worker.gpu_model_runner` (`SuffixDecodingProposer`, `EagleProposer`) with subclasses (the runner checks its
drafter with isinstance), lets `vllm.config.speculative.has_arctic_inference` pass, and wraps
`GPUModelRunner._update_states` to learn which requests finished before vLLM drops their state. None of these is public
API: they are pinned to SUPPORTED_VLLM_VERSIONS, and any other version is refused with a message, vLLM untouched.

Per request the suffix cache is driven as hybridspec's Engine drives it: `start_request` with the prompt the first time
the request has a sampled token, `append` of the tokens each step committed (cut at a stop token or max_tokens, as the
engine commits), `speculate`, and `finish_request` when vLLM finishes it normally (a stop token, max_tokens, the
model's length) or `abort_request` otherwise (an abort, a stop string the front end caught, a preemption: a request
that leaves the batch is forgotten, and restarted with its prompt and output so far when it returns).

HYBRIDSPEC_VLLM_VERIFY_COST ("default" or a verify-cost JSON) also trims every draft with the engine's CostGate, as
the engine's router does; unset, vLLM verifies every draft in full.

Nothing heavy is imported here at module level: vLLM and torch only inside `register()` and the classes it builds.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Hashable, Iterable, Sequence

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
ENV_SWITCH = "HYBRIDSPEC_VLLM"
ENV_RECORD = "HYBRIDSPEC_VLLM_RECORD"  # a directory: each process appends its proposers' events there (tests)
# The engine's cost gate on vLLM's drafts: "default" (the built-in CPU tables of SmolLM2, router/cost.py) or the JSON
# of `benchmarks/bench_verify_cost.py`; unset: every draft is verified in full, as vLLM's own methods do.
ENV_VERIFY_COST = "HYBRIDSPEC_VLLM_VERIFY_COST"
MODES = ("suffix", "hybrid")
HYBRID_METHODS = ("eagle", "eagle3")

_lock = threading.Lock()
_patched: dict[str, Any] = {}  # what register() replaced, by name: the originals (and the marker that it ran)


class PluginError(SystemExit):
    """A request for the plugin that cannot be honoured. A SystemExit, so that vLLM's plugin loader (which logs and
    ignores ordinary exceptions) does not go on serving without what the user asked for."""

    def __init__(self, message: str) -> None:
        super().__init__(f"hybridspec vLLM plugin: {message}")


def requested_modes(value: str | None = None) -> frozenset[str]:
    """The modes HYBRIDSPEC_VLLM asks for (`value` instead of the environment's, if given); empty: the plugin is off."""
    raw = os.environ.get(ENV_SWITCH, "") if value is None else value
    if raw.strip().lower() in ("", "0", "off", "false", "no"):
        return frozenset()
    modes = {part.strip().lower() for part in raw.split(",") if part.strip()}
    unknown = sorted(modes - set(MODES))
    if unknown:
        raise PluginError(f"{ENV_SWITCH}={raw!r}: unknown mode {', '.join(map(repr, unknown))}; use one of "
                          f"{', '.join(MODES)} (comma-separated for several), or unset it to leave vLLM as it is")
    return frozenset(modes)


def check_vllm_version(version: str) -> None:
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise PluginError(f"vLLM {version} is not supported (this hybridspec supports vLLM "
                          f"{', '.join(SUPPORTED_VLLM_VERSIONS)}: it replaces parts of vLLM that are not public API); "
                          f"nothing was changed. Install a supported vLLM, or unset {ENV_SWITCH} to run vLLM without "
                          f"hybridspec.")


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent, a no-op unless HYBRIDSPEC_VLLM asks for a mode."""
    modes = requested_modes()
    if not modes:
        return
    with _lock:
        if _patched:
            return
        import vllm

        check_vllm_version(getattr(vllm, "__version__", "unknown"))
        try:
            import numpy  # noqa: F401

            from hybridspec.router import CostGate, choose_draft  # noqa: F401
            from hybridspec.suffix import SuffixCache  # noqa: F401  (the compiled suffix tree)
        except ImportError as e:
            raise PluginError(f"{ENV_SWITCH} is set but hybridspec cannot load ({e}); install it into vLLM's "
                              f"environment with `pip install \"hybridspec[vllm]\"` (from a checkout: "
                              f"scripts/setup_vllm.sh), or unset {ENV_SWITCH}") from None
        import vllm.config.speculative as speculative_config
        from vllm.v1.worker import gpu_model_runner

        suffix_class, hybrid_class = _proposer_classes()
        runner = gpu_model_runner.GPUModelRunner
        _patched["GPUModelRunner._update_states"] = runner._update_states
        runner._update_states = _wrap_update_states(runner._update_states)
        if "suffix" in modes:
            _patched["SuffixDecodingProposer"] = gpu_model_runner.SuffixDecodingProposer
            gpu_model_runner.SuffixDecodingProposer = suffix_class
            # vLLM's config validation asks for ArcticInference when method == "suffix"; ours needs none
            _patched["has_arctic_inference"] = speculative_config.has_arctic_inference
            speculative_config.has_arctic_inference = lambda: True
        if "hybrid" in modes:
            _patched["EagleProposer"] = gpu_model_runner.EagleProposer
            gpu_model_runner.EagleProposer = hybrid_class


def _wrap_update_states(original):
    def _update_states(self, scheduler_output):
        drafter = getattr(self, "drafter", None)
        requests = getattr(drafter, "hybridspec_requests", None)
        if requests is not None:  # before vLLM forgets the finished requests' states
            requests.runner_requests = self.requests
            requests.on_scheduler_output(scheduler_output, self.requests)
        return original(self, scheduler_output)

    _update_states.__wrapped__ = original
    return _update_states


# ---------------------------------------------------------------------------------------------------------------------
# the request life cycle, shared by both proposers


def _stop_ids(sampling_params: Any) -> frozenset[int]:
    if sampling_params is None:
        return frozenset()
    ids = getattr(sampling_params, "all_stop_token_ids", None)
    if ids is None:
        ids = getattr(sampling_params, "_all_stop_token_ids", ())
    return frozenset(ids)


class SuffixRequests:
    """Feeds a `SuffixCache` from vLLM's persistent batch the way hybridspec's Engine feeds it (module docstring).

    `live` holds the requests started on the cache; every one of them ends in finish_request or abort_request once vLLM
    drops it, so nothing leaks. `drafted_tokens` / `draft_steps` count real draft tokens only (never padding).
    """

    def __init__(self, cache: Any, max_model_len: int, recorder: "Recorder | None" = None) -> None:
        self.cache = cache
        self.max_model_len = max_model_len
        self.live: set[str] = set()
        self.recorder = recorder
        self.runner_requests: dict | None = None  # the runner's request states (sampling params), set each step
        self._histories: dict[str, list[int]] = {}  # recording only
        self.contexts: list[int] = []  # per row of the last update: its tokens so far (the gate's context)
        self.gate = None  # a CostGate that trims drafts (HYBRIDSPEC_VLLM_VERIFY_COST), or None
        self._routed: dict[str, Any] = {}  # rid -> the Proposal vLLM verified last step (calibrates the gate)
        self.counters = dict(started=0, finished=0, aborted=0, draft_steps=0, drafted_tokens=0)

    # -- called by the runner's _update_states, before it drops finished requests
    def on_scheduler_output(self, scheduler_output: Any, requests: dict) -> None:
        for rid in list(scheduler_output.finished_req_ids):
            if rid in self.live:
                self._end(rid, self._finished_normally(requests.get(rid)))
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ()
        for rid in self.live & set(resumed):  # back from preemption: restarted on its next sampled token
            self._end(rid, False)

    def _finished_normally(self, state: Any) -> bool:
        """A stop token, max_tokens or the model's length ended it; anything else (an abort, a stop string caught by
        the front end) is an abort for the cache."""
        if state is None or not state.output_token_ids:
            return False
        output, params = state.output_token_ids, state.sampling_params
        if params is None:
            return False
        if params.max_tokens is not None and len(output) >= params.max_tokens:
            return True
        if state.num_prompt_tokens + len(output) >= self.max_model_len:
            return True
        return output[-1] in _stop_ids(params)

    def _end(self, rid: str, normally: bool) -> None:
        self.live.discard(rid)
        (self.cache.finish_request if normally else self.cache.abort_request)(rid)
        self.counters["finished" if normally else "aborted"] += 1
        if self.recorder:
            self.recorder.event("finish" if normally else "abort", rid)

    # -- called by the proposers each step
    def update(self, input_batch: Any, sampled_token_ids: Sequence[Sequence[int]], requests: dict | None,
               num_speculative_tokens: int, booked: bool = True) -> list[int]:
        """Start, append, and end what left the batch; returns each row's draft budget (0: no draft for that row).
        booked: vLLM's bookkeeping already wrote this step's sampled tokens into the batch (False: a drafter that runs
        before it, as EAGLE with the padded drafter batch does)."""
        present = input_batch.req_id_to_index
        for rid in [r for r in self.live if r not in present]:  # preempted or unscheduled: left the batch
            self._end(rid, False)
        for rid in [r for r in self._routed if r not in self.live]:
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
            tokens = list(sampled)
            state = requests.get(rid) if requests is not None else None
            params = state.sampling_params if state is not None else None
            generated_before = num_tokens - len(tokens) - num_prompt
            tokens = self._committed(tokens, generated_before, params)
            self.observe(rid, len(sampled))
            if rid not in self.live:
                history = input_batch.token_ids_cpu[i, :num_tokens - len(sampled)]
                self.cache.start_request(rid, history[:num_prompt])
                if len(history) > num_prompt:  # a preempted request returning: its output so far
                    self.cache.append(rid, history[num_prompt:])
                self.live.add(rid)
                self.counters["started"] += 1
                if self.recorder:
                    self.recorder.event("start", rid, prompt=[int(t) for t in history[:num_prompt]],
                                        output=[int(t) for t in history[num_prompt:]])
            self.cache.append(rid, tokens)
            if self.recorder:
                self.recorder.event("append", rid, tokens=tokens)
            budget = min(num_speculative_tokens, self.max_model_len - num_tokens - 1)
            if params is not None and params.max_tokens is not None:  # the engine drafts no more than still wanted
                budget = min(budget, params.max_tokens - (generated_before + len(tokens)) - 1)
            budgets.append(max(budget, 0) if len(tokens) == len(sampled) else 0)
            if self.recorder:  # the token history as vLLM holds it, for the replay in the tests
                self._histories[rid] = [int(t) for t in input_batch.token_ids_cpu[i, :num_tokens - len(sampled)]] \
                    + [int(t) for t in sampled]
        return budgets

    @staticmethod
    def _committed(tokens: list[int], generated_before: int, params: Any) -> list[int]:
        """The tokens our engine would commit: cut after a stop token (once min_tokens are out) or at max_tokens."""
        if params is None:
            return tokens
        if params.max_tokens is not None:
            tokens = tokens[:max(params.max_tokens - generated_before, 0)]
        stops = _stop_ids(params)
        for j, token in enumerate(tokens):
            if token in stops and generated_before + j + 1 > getattr(params, "min_tokens", 0):
                return tokens[:j + 1]
        return tokens

    def speculate(self, rid: str, budget: int) -> Any:
        proposal = self.cache.speculate(rid, budget)
        if self.recorder:
            self.recorder.event("speculate", rid, budget=budget, draft=list(proposal.token_ids),
                                history=self._histories.pop(rid, None))
        return proposal

    def observe(self, rid: str, num_sampled: int) -> None:
        """What vLLM accepted of the request's previous draft (all sampled tokens but the target's own) teaches the
        gate each source's acceptance, as the engine's router.observe does."""
        previous = self._routed.pop(rid, None)
        if self.gate is not None and previous is not None and num_sampled and len(previous):
            self.gate.observe([previous], [list(range(min(num_sampled - 1, len(previous))))])

    def route(self, rid: str, proposal: Any, context: int, trim: bool = True) -> list[int]:
        """The draft vLLM verifies: the proposal, trimmed by the gate where there is one (and `trim`)."""
        if self.gate is not None and trim:
            proposal = self.gate.trim(proposal, context)
            if self.recorder:
                self.recorder.event("routed", rid, draft=list(proposal.token_ids))
        if self.gate is not None and len(proposal):
            self._routed[rid] = proposal
        self.count(proposal.token_ids)
        return list(proposal.token_ids)

    def count(self, draft: Sequence[int]) -> None:
        if len(draft):
            self.counters["draft_steps"] += 1
            self.counters["drafted_tokens"] += len(draft)


class Recorder:
    """Appends one JSON line per event to DIR/<pid>-<n>.jsonl: what the tests replay through a fresh SuffixCache."""

    _count = 0

    def __init__(self, directory: str, config: dict) -> None:
        os.makedirs(directory, exist_ok=True)
        Recorder._count += 1
        self.path = os.path.join(directory, f"{os.getpid()}-{Recorder._count}.jsonl")
        self._file = open(self.path, "a", buffering=1)
        self.event("config", None, **config)

    def event(self, kind: str, rid: Hashable | None, **fields: Any) -> None:
        self._file.write(json.dumps({"event": kind, "rid": rid, **fields}) + "\n")

    def stats(self, **fields: Any) -> None:
        self.event("stats", None, **fields)


def suffix_cache_options(speculative_config: Any, vocab_size: int | None) -> dict:
    """The SuffixCache our proposers build from vLLM's suffix keys (the same for the replay in the tests). Finished
    requests are not retained: vLLM never continues one (`extends=`), so retaining would only hold memory."""
    return dict(max_depth=int(speculative_config.suffix_decoding_max_tree_depth),
                num_speculative_tokens=int(speculative_config.num_speculative_tokens),
                max_spec_factor=float(speculative_config.suffix_decoding_max_spec_factor),
                min_token_prob=float(speculative_config.suffix_decoding_min_token_prob),
                vocab_size=vocab_size, max_retained=0)


def _new_requests(vllm_config: Any, *, hybrid: bool) -> SuffixRequests:
    from hybridspec.suffix import SuffixCache

    spec = vllm_config.speculative_config
    vocab = vllm_config.model_config.get_vocab_size()
    options = suffix_cache_options(spec, vocab)
    directory = os.environ.get(ENV_RECORD)
    recorder = Recorder(directory, dict(options, hybrid=hybrid)) if directory else None
    requests = SuffixRequests(SuffixCache(**options), vllm_config.model_config.max_model_len, recorder)
    cost = os.environ.get(ENV_VERIFY_COST, "").strip()
    if cost:
        from hybridspec.router import CostGate

        try:
            requests.gate = CostGate(None if cost == "default" else cost)
        except ValueError as e:
            raise PluginError(f"{ENV_VERIFY_COST}={cost!r}: {e} (give \"default\" or the JSON written by "
                              f"benchmarks/bench_verify_cost.py)") from None
    return requests


# ---------------------------------------------------------------------------------------------------------------------
# the proposers: built on first register(), as subclasses of the classes they replace (the runner checks isinstance)


def _proposer_classes() -> tuple[type, type]:
    import torch
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    from hybridspec.proposal import Proposal
    from hybridspec.router import CostGate, choose_draft

    class HybridspecSuffixProposer(SuffixDecodingProposer):
        """vLLM's `method: "suffix"` served by hybridspec's SuffixCache (drafts of varying length, as vLLM's)."""

        def __init__(self, vllm_config: Any) -> None:  # not super().__init__: it imports ArcticInference
            self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
            self.max_model_len = vllm_config.model_config.max_model_len
            self.hybridspec_requests = _new_requests(vllm_config, hybrid=False)

        def propose(self, num_speculative_tokens: int, input_batch: Any, sampled_token_ids: list[list[int]],
                    slot_mappings: Any = None) -> list[list[int]]:
            requests = self.hybridspec_requests
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
            self.hybridspec_requests = _new_requests(vllm_config, hybrid=True)
            # the calibrated expectation the choice reads; it learns from every routed draft (observe), trims them
            # only where HYBRIDSPEC_VLLM_VERIFY_COST asks
            self.trims = self.hybridspec_requests.gate is not None
            if not self.trims:
                self.hybridspec_requests.gate = CostGate()
            self.gate = self.hybridspec_requests.gate
            self.suffix_threshold = float(spec.num_speculative_tokens)  # Arctic's rule: the drafter's K
            self.drafter_source = "peagle" if getattr(spec, "parallel_drafting", False) else spec.method
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
                best = choose_draft(requests.speculate(rid, budget), drafted, self.suffix_threshold,
                                    self.gate.expected_tokens)
                self.chosen[best.source] = self.chosen.get(best.source, 0) + 1
                if requests.recorder:
                    requests.recorder.event("chosen", rid, source=best.source, draft=list(best.token_ids))
                draft = requests.route(rid, best, requests.contexts[i], trim=self.trims)
                if best.source != self.drafter_source:
                    suffix_rows.append((i, draft))
                drafts.append(draft)
            self._one_hot_draft_probs(suffix_rows)
            return drafts

        def _one_hot_draft_probs(self, rows: Iterable[tuple[int, list[int]]]) -> None:
            """Where vLLM keeps EAGLE's draft probabilities (sampling), a suffix row gets its own, one-hot: a
            deterministic proposer's distribution, so the rejection sampler stays lossless."""
            probs = getattr(self, "_last_draft_probs", None)
            if probs is None:
                return
            for i, tokens in rows:
                probs[i].zero_()
                n = min(len(tokens), probs.shape[1])
                positions = torch.arange(n, device=probs.device)
                probs[i, positions, torch.tensor(tokens[:n], dtype=torch.long, device=probs.device)] = 1.0

    return HybridspecSuffixProposer, HybridspecHybridProposer
