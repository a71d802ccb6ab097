"""Where a prompt's prefill time goes in the engine, by part, on bench_architectures' random-weight shapes; or a
decode step's (`--decode N`).

    .venv/bin/python benchmarks/profile_prefill.py [--models qwen3-moe-8l,gpt-oss-4l] [--prompt 512] [--repeats 6]
        [--decode N] [--json out/profile_prefill.json]

`TargetModel.prefill` of one prompt on a fresh cache, timed whole and with timers around the functions a layer is made
of (`PARTS`); with `--decode N`, after one prefill, N plain greedy steps (`TargetModel.step`, argmax only, as a greedy
decode runs them) timed so, `--repeats` of them untimed first. Timers nest: each part is charged its own time
without the parts it calls (the router's product inside the MoE's routing counts as a product; profile_vllm_step.py's
`StepProfiler`), so the parts and the remainder (the forward's own glue) add up to the prefill (or the step).
torch's profiler cannot say this: the engine's kernels (attention, experts, norms) are not torch operators.
JSON: "models": {name: {ms (the prefill, or a step), ms_per_token, parts: {part: ms}, remainder_ms}}, "machine".
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
from typing import Iterator

import torch

from bench_architectures import SHAPES, build
from common import machine_info, write_json
from profile_vllm_step import STEP, StepProfiler

# (module, class, method, part): the parts of a decoder layer's prefill
PARTS = [
    ("hybridspec.model.target", "TargetModel", "_attend", "attention (cache writes and kernel)"),
    ("hybridspec.model.target", "TargetModel", "_norm_and_rotate", "query/key norms and RoPE"),
    ("hybridspec.model.target", "TargetModel", "_rms_norm", "RMS norms"),
    ("hybridspec.model.layers", "_MixtureOfExperts", "_chunk_experts", "MoE experts (panel kernel or AMX)"),
    ("hybridspec.model.layers", "_MixtureOfExperts", "experts_sum", "MoE grouping and sum"),
    ("hybridspec.model.layers", "_MixtureOfExperts", "route", "MoE routing"),
    ("hybridspec.model.layers", "_DenseMLP", "plus", "dense MLP"),
    ("hybridspec.model.linear", "Linear", "__call__", "products (qkv, router, head)"),
    ("hybridspec.model.linear", "Linear", "plus", "products with a residual (o_proj)"),
    ("hybridspec.model.delta_net", "GatedDeltaNet", "plus", "Gated DeltaNet layers"),
    ("hybridspec.model.head", "GreedyHead", "__call__", "greedy output layer (int8, rechecked)"),
]


@contextlib.contextmanager
def instrumented(profiler: StepProfiler, whole: str = "prefill") -> Iterator[None]:
    """`TargetModel.<whole>` (prefill or step) timed as the profiler's step and every part's method as its part while
    inside (the self-time timers of profile_vllm_step.py); the methods restored after."""
    targets = [("hybridspec.model.target", "TargetModel", whole, STEP), *PARTS]
    wrapped = []
    for module, cls, name, part in targets:
        owner = getattr(importlib.import_module(module), cls, None)
        if owner is not None and name in vars(owner):
            wrapped.append((owner, name, vars(owner)[name]))
            setattr(owner, name, profiler.wrap(vars(owner)[name], part))
    try:
        yield
    finally:
        for owner, name, method in wrapped:
            setattr(owner, name, method)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3-moe-8l,gpt-oss-4l", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=0, help="profile this many decode steps instead of the prefill")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hybridspec.model.target import TargetModel

    result = {"models": {}, "machine": machine_info(), "args": vars(args)}
    for name in args.models.split(","):
        target = TargetModel(build(name))
        prompt = torch.randint(1, min(1000, target.vocab_size), (args.prompt,),
                               generator=torch.Generator().manual_seed(1)).tolist()
        profiler = StepProfiler()
        with torch.inference_mode(), instrumented(profiler, "step" if args.decode else "prefill"):
            if args.decode:
                cache = target.new_cache(1, args.prompt + args.repeats + args.decode + 1)
                target.prefill(cache, [prompt])
            for warm, count in zip((True, False), (args.repeats, args.decode) if args.decode else (1, args.repeats)):
                profiler.recording = not warm
                for i in range(count):
                    if args.decode:  # a plain greedy step on a next token, kept
                        target.step(cache, [prompt[i % len(prompt)]], argmax_only=True)
                        cache.commit(0, [0])
                    else:
                        target.prefill(target.new_cache(1, args.prompt + 16), [prompt])
        runs = len(profiler.steps)
        total = 1e3 * sum(step["total"] for step in profiler.steps) / runs
        spent = collections.Counter()
        for step in profiler.steps:
            spent.update(step["parts"])
        parts = {part: s * 1e3 / runs for part, s in spent.most_common()}
        tokens = 1 if args.decode else args.prompt
        result["models"][name] = {"ms": total, "ms_per_token": total / tokens, "parts": parts,
                                  "remainder_ms": 1e3 * sum(step["remainder"] for step in profiler.steps) / runs}
        what = f"a decode step after {args.prompt} tokens" if args.decode else f"prefill of {args.prompt} tokens"
        print(f"\n{name}: {what} {total:.1f} ms ({total / tokens:.3f} ms a token)")
        print("| part | ms | share |\n|---|---|---|")
        for part, ms in [*parts.items(), ("the rest (the forward's glue)", result["models"][name]["remainder_ms"])]:
            print(f"| {part} | {ms:.1f} | {ms / total:.0%} |")
        del target
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
