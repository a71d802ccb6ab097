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
method sees no request ids and no hidden states, so `register()` applies the patches of `PATCHES`: each target is
checked to exist first, all are applied or none (a failure restores what was patched, logs one error and leaves vLLM
as it was), and each is logged. None of their targets is public API: they are pinned to SUPPORTED_VLLM_VERSIONS, and
any other version is refused with a message, vLLM untouched. The proposers themselves are in `vllm_proposers`.

Per request the suffix cache is driven as hybridspec's Engine drives it: `start_request` with the prompt the first time
the request has a sampled token, `append` of the tokens each step committed (cut by the engine's commit rules,
`hybridspec.commit`), `speculate`, and `finish_request` when vLLM finishes it normally (a stop token, max_tokens, the
model's length) or `abort_request` otherwise (an abort, a stop string the front end caught, a preemption: a request
that leaves the batch is forgotten, and restarted with its prompt and output so far when it returns).

HYBRIDSPEC_VLLM_VERIFY_COST ("default" or a verify-cost JSON) also trims every draft with the engine's CostGate, as
the engine's router does; unset, vLLM verifies every draft in full. HYBRIDSPEC_VLLM_OBSERVER ("module:Class") hands
every life-cycle event to an observer (the tests record them with it).

Nothing heavy is imported here at module level: vLLM and torch only inside `register()` and `vllm_proposers`.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hybridspec.commit import StopRules, commit_tokens, draft_budget

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
ENV_SWITCH = "HYBRIDSPEC_VLLM"
ENV_OBSERVER = "HYBRIDSPEC_VLLM_OBSERVER"  # "module:Class": Class(config) gets event(kind, rid, **fields) calls
# The engine's cost gate on vLLM's drafts: "default" (the built-in CPU tables of SmolLM2, router/cost.py) or the JSON
# of `benchmarks/bench_verify_cost.py`; unset: every draft is verified in full, as vLLM's own methods do.
ENV_VERIFY_COST = "HYBRIDSPEC_VLLM_VERIFY_COST"
MODES = ("suffix", "hybrid")
HYBRID_METHODS = ("eagle", "eagle3")

logger = logging.getLogger("vllm.hybridspec")  # a child of vLLM's logger: its handler and format

_lock = threading.Lock()
_applied: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) of every patch in force


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


# ---------------------------------------------------------------------------------------------------------------------
# the patches


@dataclass(frozen=True)
class Patch:
    """Replace `attribute` of `target` ("module" or "module:Class") by `replacement(original)`, for `mode` (None:
    whenever the plugin is on)."""

    target: str
    attribute: str
    replacement: Callable[[Any], Any]
    mode: str | None = None
    why: str = ""

    def owner(self) -> Any:
        module, _, qualname = self.target.partition(":")
        owner = importlib.import_module(module)
        for name in filter(None, qualname.split(".")):
            owner = getattr(owner, name)
        return owner


def _suffix_proposer(original: Any) -> Any:
    from hybridspec.vllm_proposers import HybridspecSuffixProposer

    return HybridspecSuffixProposer


def _hybrid_proposer(original: Any) -> Any:
    from hybridspec.vllm_proposers import HybridspecHybridProposer

    return HybridspecHybridProposer


def _wrap_update_states(original: Callable) -> Callable:
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        # `drafter` exists only with a speculative config, and may be vLLM's own proposer (another method)
        requests = getattr(getattr(self, "drafter", None), "hybridspec_requests", None)
        if requests is not None:  # before vLLM forgets the finished requests' states
            requests.runner_requests = self.requests
            requests.on_scheduler_output(scheduler_output, self.requests)
        return original(self, scheduler_output)

    _update_states.__wrapped__ = original
    return _update_states


RUNNER = "vllm.v1.worker.gpu_model_runner"
PATCHES: tuple[Patch, ...] = (
    Patch(f"{RUNNER}:GPUModelRunner", "_update_states", _wrap_update_states,
          why="learn which requests finished before vLLM drops their state"),
    Patch(RUNNER, "SuffixDecodingProposer", _suffix_proposer, "suffix",
          why="method 'suffix' drafts from hybridspec's SuffixCache (the runner checks its drafter with isinstance: "
              "the replacement subclasses it)"),
    Patch("vllm.config.speculative", "has_arctic_inference", lambda original: lambda: True, "suffix",
          why="config validation asks for ArcticInference when method == 'suffix'; ours needs none"),
    Patch(RUNNER, "EagleProposer", _hybrid_proposer, "hybrid",
          why="methods 'eagle'/'eagle3' become the suffix + EAGLE hybrid"),
)


def apply_patches(patches: Sequence[Patch], modes: frozenset[str]) -> bool:
    """Apply every patch for `modes`, all or nothing: each target and attribute is checked first, and a failure
    restores what was already patched and logs one error (vLLM then runs unchanged). Returns whether they apply."""
    wanted = [p for p in patches if p.mode is None or p.mode in modes]
    done: list[tuple[Any, str, Any]] = []
    try:
        owners = [p.owner() for p in wanted]
        missing = [f"{p.target}.{p.attribute}" for p, o in zip(wanted, owners) if not hasattr(o, p.attribute)]
        if missing:
            raise AttributeError(f"not found: {', '.join(missing)}")
        for patch, owner in zip(wanted, owners):
            original = getattr(owner, patch.attribute)
            replacement = patch.replacement(original)
            setattr(owner, patch.attribute, replacement)
            done.append((owner, patch.attribute, original))
    except Exception as e:  # noqa: BLE001 - whatever failed, vLLM must be left as it was
        for owner, attribute, original in reversed(done):
            setattr(owner, attribute, original)
        logger.error("hybridspec: could not patch vLLM (%s: %s); nothing was changed, vLLM runs without hybridspec",
                     type(e).__name__, e)
        return False
    _applied.extend(done)
    for patch in wanted:
        why = f" ({patch.why})" if patch.why else ""
        logger.info("hybridspec: patched %s.%s%s", patch.target, patch.attribute, why)
    return True


def restore_patches() -> None:
    """Undo every patch in force (tests; a process that wants vLLM back as it was)."""
    with _lock:
        while _applied:
            owner, attribute, original = _applied.pop()
            setattr(owner, attribute, original)


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent, a no-op unless HYBRIDSPEC_VLLM asks for a mode."""
    modes = requested_modes()
    if not modes:
        return
    with _lock:
        if _applied:
            return
        import vllm

        check_vllm_version(vllm.__version__)
        try:
            import numpy  # noqa: F401

            from hybridspec.router import CostGate, choose_draft  # noqa: F401
            from hybridspec.suffix import SuffixCache  # noqa: F401  (the compiled suffix tree)
        except ImportError as e:
            raise PluginError(f"{ENV_SWITCH} is set but hybridspec cannot load ({e}); install it into vLLM's "
                              f"environment with `pip install \"hybridspec[vllm]\"` (from a checkout: "
                              f"scripts/setup_vllm.sh), or unset {ENV_SWITCH}") from None
        apply_patches(PATCHES, modes)


def announce(method: str, by: str) -> None:
    """The one line that says hybridspec took a speculative method over in this process."""
    from hybridspec import __version__

    logger.info("hybridspec %s: vLLM's speculative method %r is served by %s", __version__, method, by)


# ---------------------------------------------------------------------------------------------------------------------
# the request life cycle, shared by both proposers


class SuffixRequests:
    """Feeds a `SuffixCache` from vLLM's persistent batch the way hybridspec's Engine feeds it (module docstring).

    `live` holds the requests started on the cache; every one of them ends in finish_request or abort_request once vLLM
    drops it, so nothing leaks. `counters["drafts"]` / `["draft_tokens"]` count real drafts only (never padding).
    """

    def __init__(self, cache: Any, max_model_len: int, observer: Any = None) -> None:
        self.cache = cache
        self.max_model_len = max_model_len
        self.live: set[str] = set()
        self.observer = observer
        self.runner_requests: dict | None = None  # the runner's request states (sampling params), set each step
        self._histories: dict[str, list[int]] = {}  # for the observer only
        self.contexts: list[int] = []  # per row of the last update: its tokens so far (the gate's context)
        self.gate = None  # a CostGate that trims drafts (HYBRIDSPEC_VLLM_VERIFY_COST), or None
        self._routed: dict[str, Any] = {}  # rid -> the Proposal vLLM verified last step (calibrates the gate)
        self.counters = dict(started=0, finished=0, aborted=0, drafts=0, draft_tokens=0)

    def event(self, kind: str, rid: str | None, **fields: Any) -> None:
        if self.observer is not None:
            self.observer.event(kind, rid, **fields)

    def rules(self, params: Any) -> StopRules:
        """The engine's stop rules for a request with vLLM's sampling params (None: only the model's length)."""
        if params is None:
            return StopRules(frozenset(), None, self.max_model_len)
        return StopRules(params.all_stop_token_ids, params.max_tokens, self.max_model_len, params.min_tokens)

    # -- called by the runner's _update_states, before it drops finished requests
    def on_scheduler_output(self, scheduler_output: Any, requests: dict) -> None:
        for rid in list(scheduler_output.finished_req_ids):
            if rid in self.live:
                self._end(rid, self._finished_normally(requests.get(rid)))
        for rid in self.live & scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            self._end(rid, False)  # back from preemption: restarted on its next sampled token

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
        self.live.discard(rid)
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
            state = requests.get(rid) if requests is not None else None
            rules = self.rules(state.sampling_params if state is not None else None)
            before = num_tokens - len(sampled)
            tokens, reason = commit_tokens(list(sampled), before - num_prompt, before, rules)
            self.observe(rid, len(sampled))
            if rid not in self.live:
                history = input_batch.token_ids_cpu[i, :before]
                self.cache.start_request(rid, history[:num_prompt])
                if len(history) > num_prompt:  # a preempted request returning: its output so far
                    self.cache.append(rid, history[num_prompt:])
                self.live.add(rid)
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

    def route(self, rid: str, proposal: Any, context: int, trim: bool = True) -> list[int]:
        """The draft vLLM verifies: the proposal, trimmed by the gate where there is one (and `trim`)."""
        if self.gate is not None and trim:
            proposal = self.gate.trim(proposal, context)
            self.event("routed", rid, draft=list(proposal.token_ids))
        if self.gate is not None and len(proposal):
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
            requests.gate = CostGate(None if cost == "default" else cost)
        except ValueError as e:
            raise PluginError(f"{ENV_VERIFY_COST}={cost!r}: {e} (give \"default\" or the JSON written by "
                              f"benchmarks/bench_verify_cost.py)") from None
    return requests
