"""The target's verification cost on this machine: t(1 + k tokens) / t(1 token), per warm context length.

The router's cost gate plans with such a table: the engine measures its own once per machine and model
(`hybridspec.model.calibration`, `Engine(verify_cost="auto")`, what `hybridspec calibrate` re-measures);
`router/cost.py`
holds the built-in ones (`verify_cost=None`), measured with this script on SmolLM2; `Engine(verify_cost=PATH)` takes
the JSON this script writes. --batch also times a plain step at batch
1, 2, 4 and 8 (one padded cache, the weights read once per step); --prefill P+N,... times a prefill of N new tokens
after P cached ones (a cold call: 0+N; an agent's next call: its earlier calls cached, the rest new); --calls N,...
times one plain step of N concurrent calls (one one-row cache each, at the first --context), their attention joined
in one kernel call per layer (`Attention.join_steps`) and one call per cache.

    python benchmarks/bench_verify_cost.py --threads 1 --context 512,2048,4096 --repeats 9 --json out/verify_cost.json
    python benchmarks/bench_verify_cost.py --batch --no-verify-cost --threads 1
    python benchmarks/bench_verify_cost.py --threads 1 --context 2048 --plain-max-rows 0   # oneDNN for every product
    python benchmarks/bench_verify_cost.py --prefill 0+455,0+1490,0+2853,2989+1274 --no-verify-cost --threads 1
    python benchmarks/bench_verify_cost.py --products --no-verify-cost --threads 2   # products by row count
    python benchmarks/bench_verify_cost.py --threads 2 --context 2048 --no-kernel   # without the small-row kernel
    python benchmarks/bench_verify_cost.py --calls 32,64 --context 50,2000 --no-verify-cost --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from common import machine_info, median_ms_each, write_json
from hybridspec.model.calibration import DEFAULT_COST_DRAFT_TOKENS, measure_verify_cost
from hybridspec.model.linear import KERNEL_ROWS, MKL_ROWS, PLANNED_ROWS, time_routes, tune_products, untuned_routes
from hybridspec.model.machine import work_clock
from hybridspec.model.target import TargetModel

def measure_prefill(target: TargetModel, cached: int, new: int, repeats: int = 3, seed: int = 0) -> dict:
    """Median wall time of prefilling `new` tokens into a cache already holding `cached` (random token ids)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (cached + new,), generator=gen).tolist()
    times = []
    for _ in range(repeats):
        cache = target.new_cache(1, capacity=cached + new)
        if cached:
            target.prefill(cache, [tokens[:cached]])
        start = time.perf_counter()
        target.prefill(cache, [tokens[cached:]])
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"cached": cached, "new": new, "s": round(seconds, 4), "ms_per_token": round(1000 * seconds / new, 3)}


def measure_calls_step(target: TargetModel, calls: int, context: int, repeats: int = 7) -> dict:
    """Median ms of one greedy plain step of `calls` one-row caches at `context` tokens, their attention joined in one
    kernel call per layer and one call per cache (the caches hold random keys; the times do not depend on them)."""
    from hybridspec.model.attention import Attention
    from hybridspec.model.inputs import StepInput

    caches = [target.new_cache(1, context + 1) for _ in range(calls)]
    for cache in caches:
        cache.lengths[0] = context
    joining = Attention.join_steps
    ways = {"joined": joining, "apart": lambda self, *a: []}

    def step() -> None:
        target.step_many([StepInput(c, [5]) for c in caches], argmax_only=True)

    try:  # the two take turns step by step
        ms = median_ms_each({name: step for name in ways}, repeats,
                            before={name: lambda way=way: setattr(Attention, "join_steps", way)
                                    for name, way in ways.items()})
    finally:
        Attention.join_steps = joining
    return {"calls": calls, "context": context, "joined_ms": round(ms["joined"], 1), "apart_ms": round(ms["apart"], 1)}


def time_kernel(layers, repeats: int) -> dict[int, float]:
    """Seconds of the layers' products by the small-row kernel, in order, by row count: the fastest of the repeats."""
    clock, best = work_clock(), {}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # round 0 warms up
            for rows in range(1, KERNEL_ROWS + 1):
                inputs = {lin.shape[1]: torch.randn(rows, lin.shape[1]) for lin in layers}
                start = clock()
                for lin in layers:
                    lin._kernel_product(inputs[lin.shape[1]], rows, None)
                if round_:
                    best[rows] = min(best.get(rows, float("inf")), clock() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", action="store_true", help="also time a plain step at batch 1, 2, 4, 8")
    parser.add_argument("--no-verify-cost", action="store_true", help="skip t(1+k)/t(1) (with --batch or --prefill)")
    parser.add_argument("--prefill", help="time prefills of N new tokens after P cached ones: P+N, comma-separated")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", default="512", help="warm context length(s), comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--draft-tokens", default=",".join(map(str, DEFAULT_COST_DRAFT_TOKENS)))
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-pack", action="store_true", help="plain F.linear instead of prepacked oneDNN weights")
    parser.add_argument("--plain-max-rows", type=int,
                        help="untuned products: MKL's product up to this many rows, oneDNN's for more, no padding "
                             "(0: always oneDNN's; default: the routes tuned for this machine)")
    parser.add_argument("--no-kernel", action="store_true",
                        help="products by the routes alone and torch's norms, as on a CPU without the small-row "
                             "product and norm kernels")
    parser.add_argument("--sampling", action="store_true", help="steps with full logits (default: greedy steps)")
    parser.add_argument("--products", action="store_true",
                        help="also time a step's products by row count, MKL's, oneDNN's (what tune_products "
                             "measures) and the small-row kernel's: every layer's weights streamed from memory, as in "
                             "a step")
    parser.add_argument("--calls", help="time a plain step of N concurrent calls' one-row caches at each --context, "
                                        "joined and apart: N, comma-separated")
    parser.add_argument("--json", type=Path, help="write the measurement here")
    args = parser.parse_args(argv)
    if args.no_verify_cost and not (args.batch or args.prefill or args.products or args.calls):
        parser.error("nothing to do: --no-verify-cost without --batch, --prefill, --products or --calls")
    try:
        prefills = [tuple(int(n) for n in spec.split("+")) for spec in args.prefill.split(",")] if args.prefill else []
    except ValueError:
        parser.error(f"--prefill takes P+N pairs (cached + new tokens), got {args.prefill!r}")
    if any(len(p) != 2 or p[0] < 0 or p[1] < 1 for p in prefills):
        parser.error(f"--prefill takes P+N pairs with P >= 0 and N >= 1, got {args.prefill!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained(args.model, dtype=getattr(torch, args.dtype), pack_weights=not args.no_pack,
                                         tune=args.plain_max_rows is None)
    if args.no_kernel:
        target.norm_kernel = False
        for lin in target.linears():
            lin.kernel_rows = 0
        if args.plain_max_rows is None:
            tune_products(target.linears())
    if args.plain_max_rows is not None:
        for lin in target.linears():
            lin.routes = untuned_routes(args.plain_max_rows)
    result = {}
    contexts = [int(c) for c in args.context.split(",")]
    if not args.no_verify_cost:
        ks = [int(k) for k in args.draft_tokens.split(",")]
        by_context = []
        for context in contexts:
            cost = measure_verify_cost(target, ks, context=context, repeats=args.repeats, greedy=not args.sampling)
            routes = "tuned" if args.plain_max_rows is None else f"untuned: MKL up to {args.plain_max_rows} rows"
            cost.update(machine=machine_info(),
                        products=f"{'routes' if args.no_kernel else 'small-row kernel'}, {routes}")
            by_context.append(cost)
            print(f"verify cost at {cost['context']} context, {cost['dtype']}, {cost['threads']} threads, "
                  f"{'greedy' if cost['greedy'] else 'sampling'} steps")
            print(f"{'draft tokens k':>15} {'ms':>9} {'t(1+k)/t(1)':>12}   (timed by {cost['clock']})")
            for k, t, r in zip(cost["draft_tokens"], cost["ms"], cost["relative"]):
                print(f"{k:>15} {t:>9.1f} {r:>12.2f}")
        # the first context's table at the top level (what readers of one table take), every context under by_context
        result["verify_cost"] = dict(by_context[0], by_context=by_context) if len(by_context) > 1 else by_context[0]
    if args.batch:
        rows = []
        for bsz in (1, 2, 4, 8):
            c = measure_verify_cost(target, (0,), context=contexts[0], batch_size=bsz, repeats=args.repeats)
            rows.append({"batch_size": bsz, "ms": c["ms"][0]})
        result["batch_step"] = rows
        print(f"{'batch':>6} {'ms/step':>9} {'ms/token':>9}")
        for r in rows:
            print(f"{r['batch_size']:>6} {r['ms']:>9.1f} {r['ms'] / r['batch_size']:>9.1f}")
    if args.products:
        # ms of all of a step's products (the model's layers; not the output layer) per route, best of the repeats
        layers = [lin for lin in target.linears() if lin is not target.lm_head]
        timed = time_routes(layers, repeats=args.repeats)
        table = {kernel: {rows: round(1000 * sum(t[(kernel == "mkl", rows)] for t in timed.values()), 2)
                          for rows in range(1, (MKL_ROWS if kernel == "mkl" else PLANNED_ROWS) + 1)}
                 for kernel in ("mkl", "onednn")}
        if KERNEL_ROWS and not args.no_kernel and all(lin.kernel_rows for lin in layers):
            table["kernel"] = {rows: round(1000 * ms, 2) for rows, ms in time_kernel(layers, args.repeats).items()}
        result["products_ms"] = table
        print(f"{'rows':>6} {'MKL ms':>9} {'oneDNN ms':>10} {'kernel ms':>10}  (a step's products, every layer's "
              "weights from memory)")
        for rows in range(1, PLANNED_ROWS + 1):
            cells = [table[k].get(rows) for k in ("mkl", "onednn", "kernel") if k in table]
            print(f"{rows:>6} " + " ".join(f"{'-' if c is None else f'{c:.1f}':>{w}}"
                                           for c, w in zip(cells, (9, 10, 10))))
    if prefills:
        result["prefill"] = [measure_prefill(target, cached, new) for cached, new in prefills]  # 3 runs each
        print(f"{'cached':>7} {'new':>6} {'s':>8} {'ms/token':>9}")
        for r in result["prefill"]:
            print(f"{r['cached']:>7} {r['new']:>6} {r['s']:>8.3f} {r['ms_per_token']:>9.2f}")
    if args.calls:
        result["calls_step"] = [measure_calls_step(target, int(n), context, args.repeats)
                                for n in args.calls.split(",") for context in contexts]
        print(f"{'calls':>6} {'context':>8} {'joined ms':>10} {'apart ms':>9}  (one plain step, one cache per call)")
        for r in result["calls_step"]:
            print(f"{r['calls']:>6} {r['context']:>8} {r['joined_ms']:>10.1f} {r['apart_ms']:>9.1f}")
    write_json(args.json, result["verify_cost"] if list(result) == ["verify_cost"] else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
