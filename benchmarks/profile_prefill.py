"""Where a prompt's prefill time goes in the engine, by part, on bench_architectures' random-weight shapes.

    .venv/bin/python benchmarks/profile_prefill.py [--models qwen3-moe-8l,gpt-oss-4l] [--prompt 512] [--repeats 6]
        [--json out/profile_prefill.json]

`TargetModel.prefill` of one prompt on a fresh cache, timed whole and with timers around the functions a layer is made
of (`PARTS`). Timers nest: each part is charged its own time without the parts it calls (the router's product inside
the MoE's routing counts as a product; profile_vllm_step.py's `StepProfiler`), so the parts and the remainder (the
forward's own glue) add up to the prefill.
torch's profiler cannot say this: the engine's kernels (attention, experts, norms) are not torch operators.
JSON: "models": {name: {ms (the prefill), ms_per_token, parts: {part: ms}, remainder_ms}}, "machine".
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
    ("hybridspec.model.layers", "_MixtureOfExperts", "_chunk_experts", "MoE experts (panel kernel)"),
    ("hybridspec.model.layers", "_MixtureOfExperts", "experts_sum", "MoE grouping and sum"),
    ("hybridspec.model.layers", "_MixtureOfExperts", "route", "MoE routing"),
    ("hybridspec.model.layers", "_DenseMLP", "plus", "dense MLP"),
    ("hybridspec.model.linear", "Linear", "__call__", "products (qkv, router, head)"),
    ("hybridspec.model.linear", "Linear", "plus", "products with a residual (o_proj)"),
    ("hybridspec.model.delta_net", "GatedDeltaNet", "plus", "Gated DeltaNet layers"),
]


@contextlib.contextmanager
def instrumented(profiler: StepProfiler) -> Iterator[None]:
    """`TargetModel.prefill` timed as the profiler's step and every part's method as its part while inside (the
    self-time timers of profile_vllm_step.py); the methods restored after."""
    targets = [("hybridspec.model.target", "TargetModel", "prefill", STEP), *PARTS]
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
        with torch.inference_mode(), instrumented(profiler):
            for warm in (True, False):
                profiler.recording = not warm
                for _ in range(1 if warm else args.repeats):
                    target.prefill(target.new_cache(1, args.prompt + 16), [prompt])
        total = 1e3 * sum(step["total"] for step in profiler.steps) / args.repeats
        spent = collections.Counter()
        for step in profiler.steps:
            spent.update(step["parts"])
        parts = {part: s * 1e3 / args.repeats for part, s in spent.most_common()}
        result["models"][name] = {"ms": total, "ms_per_token": total / args.prompt, "parts": parts,
                                  "remainder_ms": 1e3 * sum(step["remainder"] for step in profiler.steps)
                                  / args.repeats}
        print(f"\n{name}: prefill of {args.prompt} tokens {total:.1f} ms ({total / args.prompt:.3f} ms a token)")
        print("| part | ms | share |\n|---|---|---|")
        for part, ms in [*parts.items(), ("the rest (the forward's glue)", result["models"][name]["remainder_ms"])]:
            print(f"| {part} | {ms:.1f} | {ms / total:.0%} |")
        del target
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
