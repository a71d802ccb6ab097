"""What a verification pass costs on this machine: the table the router's cost gate plans with (`Engine(verify_cost=
"auto")`, the default), measured once per machine and model and kept in the user cache; and what a drafter's draft
costs here, which a hybrid weighs against it (`machine_draft_cost`).

Why measured here rather than built in: which draft sizes are nearly free depends on the CPU. On an Intel Xeon a
pass over four draft tokens cost 1.39 plain steps; on an AMD EPYC (Zen 4), once its products run their fastest routes
(`hybridspec.model.linear.tune_products`), about 1.1. A gate that plans with another machine's table drafts too little
there, or too much.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

import numpy as np

from hybridspec.model.inputs import StepInput
from hybridspec.model.loading import first_run
from hybridspec.model.machine import keep_measured, measured_here, work_clock
from hybridspec.model.target import TargetModel

DEFAULT_COST_DRAFT_TOKENS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32)
AUTO_CONTEXTS = (512, 2048, 4096)  # as the built-in tables (router/cost.py)
# bump when the measurement changes: cached tables of older versions are measured again (3: timed by `work_clock`,
# the fastest repeat; version 2's wall-clock medians, measured beside other work, had a pass of 2 tokens at 4x one;
# 4: the small-row product kernel made every pass of a few tokens cheaper; 5: its prefetch, a pass of 2-8 tokens)
CALIBRATION_VERSION = 5
TABLES_FILE = f"verify_cost_v{CALIBRATION_VERSION}.json"  # in the user cache, per machine


def measure_verify_cost(target: TargetModel, draft_tokens: Sequence[int] = DEFAULT_COST_DRAFT_TOKENS,
                        context: int = 512, batch_size: int = 1, repeats: int = 7, seed: int = 0,
                        greedy: bool = True, prefill: bool = True) -> dict:
    """Time one pass over [last token] + k draft tokens at a warm `context`-token cache, for each k; greedy: as the
    engine runs a greedy step (only the logits' argmax needed), else with full logits (sampling). prefill=False
    fills the cache with `context` zero keys and values instead of running a prefill (seconds less; attention costs
    the same whatever the values).

    Reports the fastest of `repeats` passes per k by `work_clock` (on one thread its CPU time: other processes'
    load does not count), interleaving the sizes round by round so that load spreads over all of them alike;
    `relative[i]` = t(1 + k_i) / t(1).
    """
    gen = torch.Generator().manual_seed(seed)
    cache = target.new_cache(batch_size, capacity=context + max(draft_tokens) + 1)
    if prefill:
        target.prefill(cache, torch.randint(0, target.vocab_size, (batch_size, context), generator=gen).tolist())
    else:
        cache.reserve(context + max(draft_tokens) + 1)
        cache.lengths[:] = [context] * batch_size
    clock = work_clock()
    times: dict[int, list[float]] = {k: [] for k in draft_tokens}
    for round_ in range(repeats + 1):
        for k in draft_tokens:
            drafts = [torch.randint(0, target.vocab_size, (k,), generator=gen).tolist() for _ in range(batch_size)]
            start = clock()
            target.step(cache, [1] * batch_size, drafts, argmax_only=greedy)
            if round_ > 0:  # round 0 warms up every shape
                times[k].append(clock() - start)
    ms = [1000 * min(times[k]) for k in draft_tokens]
    base = ms[list(draft_tokens).index(0)] if 0 in draft_tokens else ms[0]
    return {"draft_tokens": list(draft_tokens), "ms": [round(t, 3) for t in ms],
            "relative": [round(t / base, 4) for t in ms], "clock": clock.__name__, "context": context,
            "batch_size": batch_size, "greedy": greedy,
            "dtype": str(target.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "model": target.config.name_or_path, "repeats": repeats}


PASS_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PASS_ROWS = (1, 8, 32)


def measure_pass_cost(target: TargetModel, tokens: Sequence[int] = PASS_TOKENS, rows: Sequence[int] = PASS_ROWS,
                      context: int = 16, repeats: int = 3, seed: int = 0) -> dict:
    """What a batched step's pass costs besides attention, for the router's batch plan (`router.cost.PassCost`):
    "tokens_ms", a greedy pass over n tokens in all for each n of "tokens" (one row, [last token] + n - 1 draft
    tokens, at a `context` too short for attention to count); "per_row_ms", the work each further row adds (r
    one-row caches, as r calls, one token each, against one row of r tokens). The fastest of `repeats` by
    `work_clock`, the sizes taking turns."""
    gen = torch.Generator().manual_seed(seed)

    def cache():
        c = target.new_cache(1, capacity=context + max(tokens) + 1)
        c.lengths[:] = [context]
        return c

    one = cache()
    many = [cache() for _ in range(max(rows))]
    clock = work_clock()
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(repeats + 1):
        for kind, sizes in (("tokens", tokens), ("rows", rows)):
            for n in sizes:
                ids = torch.randint(0, target.vocab_size, (n,), generator=gen).tolist()
                inputs = [StepInput(one, [ids[0]], [ids[1:]])] if kind == "tokens" else \
                    [StepInput(c, [t], [[]]) for c, t in zip(many, ids)]
                start = clock()
                target.step_many(inputs, argmax_only=True)
                if round_:  # round 0 warms every shape up
                    times.setdefault((kind, n), []).append(1000 * (clock() - start))
    ms = {key: min(t) for key, t in times.items()}
    tokens_ms = [round(ms["tokens", n], 3) for n in tokens]
    per_row = [(ms["rows", r] - float(np.interp(r, list(tokens), tokens_ms))) / (r - 1) for r in rows if r > 1]
    return {"tokens": list(tokens), "tokens_ms": tokens_ms,
            "per_row_ms": round(max(0.0, statistics.median(per_row)), 4) if per_row else 0.0,
            "context": context, "threads": torch.get_num_threads(), "repeats": repeats, "clock": clock.__name__}


def _model_key(target: TargetModel) -> str:
    c = target.config
    return (f"{c.model_type} {target.num_layers} layers {target.hidden_size} hidden {target.num_heads}/"
            f"{target.num_kv_heads} heads {getattr(c, 'intermediate_size', '?')} mlp {target.vocab_size} vocab "
            f"{str(target.dtype).removeprefix('torch.')} {target.device.type}")


def machine_verify_cost(target: TargetModel, *, contexts: Sequence[int] = AUTO_CONTEXTS, repeats: int = 3,
                        remeasure: bool = False, progress: bool = True) -> dict[str, Any]:
    """This machine's verify-cost tables for `target` ({"by_context": [...], "pass": {...}}, what `CostGate` reads:
    one row's pass by draft size at each context, and a batched pass by tokens and rows, `measure_pass_cost`): from
    the user cache, else measured (about 20 s for SmolLM2 on a 2-core CPU, saying so on stderr; `progress`: a line per
    table) and stored there.
    Contexts past the model's length are left out. `hybridspec calibrate` measures again (remeasure=True)."""
    fits = [c for c in contexts if c + max(DEFAULT_COST_DRAFT_TOKENS) + 1 <= target.max_seq_len]
    contexts = fits or [max(1, target.max_seq_len - max(DEFAULT_COST_DRAFT_TOKENS) - 1)]
    model, stored = _model_key(target), measured_here(TABLES_FILE)
    tables, passes = stored.get(model), stored.get(f"{model} pass")
    if remeasure or tables is None or passes is None or [t["context"] for t in tables] != list(contexts):
        with first_run("measuring what a verification pass costs on this machine") as note:
            tables = []
            for i, context in enumerate(contexts, start=1):
                start = time.perf_counter()
                tables.append(measure_verify_cost(target, context=context, repeats=repeats, prefill=False))
                if progress:
                    note(f"{i}/{len(contexts) + 1}: passes of 1-{1 + max(DEFAULT_COST_DRAFT_TOKENS)} tokens at "
                         f"{context} tokens of context ({time.perf_counter() - start:.1f} s)")
            start = time.perf_counter()
            passes = measure_pass_cost(target, repeats=repeats)
            if progress:
                note(f"{len(contexts) + 1}/{len(contexts) + 1}: passes of several rows "
                     f"({time.perf_counter() - start:.1f} s)")
        keep_measured(TABLES_FILE, {**stored, model: tables, f"{model} pass": passes})
    return {"by_context": tables, "pass": passes}


# positions a lazy drafter catches up before it drafts (64: the default drafter_context)
DRAFT_COST_POSITIONS = (1, 16, 64)


def measure_draft_cost(drafter: Any, feature_width: int, hidden_size: int, vocab_size: int,
                       positions: Sequence[int] = DRAFT_COST_POSITIONS, context: int = 64, repeats: int = 5
                       ) -> dict[int, float]:
    """ms of one draft of the drafter's K after catching up n positions it had not run, for each n in `positions`
    (the fastest of `repeats` by `work_clock`, the sizes taking turns), from a state that had run `context` positions
    before; random features of the target's shape (the cost does not depend on their values)."""
    from hybridspec.speculators import TargetFeatures

    gen = torch.Generator().manual_seed(0)
    k = drafter.num_speculative_tokens

    def features(n: int) -> TargetFeatures:
        return TargetFeatures(torch.randn(n, feature_width, generator=gen), torch.randn(n, hidden_size, generator=gen))

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=gen)

    clock = work_clock()
    times: dict[int, list[float]] = {n: [] for n in positions}
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            for n in positions:
                state = drafter.begin(features(context), tokens(context))
                drafter.propose(state, k)
                drafter.accept(state, features(n), tokens(n))
                start = clock()
                drafter.propose(state, k)
                if round_:  # round 0 warms every shape up
                    times[n].append(1000 * (clock() - start))
    return {n: round(min(t), 3) for n, t in times.items()}


def machine_draft_cost(drafter: Any, target: TargetModel, *, remeasure: bool = False) -> dict[int, float]:
    """This machine's draft-cost table ({positions caught up: ms}, what `DraftCost` reads) for a drafter loaded for
    `target` as the engine runs it: from the user cache, else measured (well under a second) and stored there."""
    params = next(drafter.parameters(), None)
    key = (f"drafter {drafter.name} K={drafter.num_speculative_tokens} "
           f"{sum(p.numel() for p in drafter.parameters())} parameters "
           f"{str(params.dtype if params is not None else '').removeprefix('torch.')} on {_model_key(target)}")
    stored = measured_here(TABLES_FILE)
    table = stored.get(key)
    if remeasure or table is None:
        width = len(target.aux_layer_ids) * target.hidden_size
        table = measure_draft_cost(drafter, width, target.hidden_size, target.vocab_size)
        keep_measured(TABLES_FILE, {**stored, key: {str(n): ms for n, ms in table.items()}})
    return {int(n): float(ms) for n, ms in table.items()}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine's fastest products and verification costs again",
        description="Measure again what the engine measures on first use and keeps in the user cache: each product's "
                    "fastest kernel and row count (hybridspec.model.linear.tune_products) and the verification "
                    "cost table the router plans with. On one thread it times the passes' own CPU time, so work "
                    "beside it does not skew the tables; on several, run it on a quiet machine. Again after a "
                    "hardware or torch change.")
    parser.add_argument("model", nargs="?", default="smollm2", help="'smollm2' or a local Hugging Face directory")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads the engine will run with")
    parser.set_defaults(func=_calibrate)


def _calibrate(args) -> int:
    from hybridspec.model.linear import tune_products

    if args.threads < 1:
        raise SystemExit("--threads must be positive")
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained(args.model, tune=False)
    plans = tune_products(target.linears(), remeasure=True)
    print("products (rows -> kernel, rows run):")
    for family, routes in plans.items():
        print(f"  {family}: " + ", ".join(f"{n}->{'mkl' if plain else 'onednn'}@{m}"
                                           for n, (plain, m) in enumerate(routes) if n))
    tables = machine_verify_cost(target, remeasure=True)["by_context"]
    print("verification cost, t(k) / t(0) for k draft tokens:")
    for t in tables:
        print(f"  {t['context']:>5} tokens of context: t(0) = {t['ms'][0]:.1f} ms; " + ", ".join(
            f"{k}: {r:.2f}" for k, r in zip(t["draft_tokens"], t["relative"]) if k))
    from hybridspec.model.loading import cache_dir

    print(f"kept in {cache_dir()}")
    return 0
