"""One mixture-of-experts layer on a prompt chunk, the ways the engine can multiply its experts, in one process.

The layer of `bench_architectures.py`'s Qwen3-MoE (64 experts of 384, 8 a token) and gpt-oss (32 experts of 1,024, 4
a token, biases, clamped SwiGLU) shapes, random weights of bfloat16 values (as published), a chunk of prompt tokens:
`_MixtureOfExperts.plus` (router, experts, weighted sum) with the experts by the panel kernel (the engine's prompt
path without AMX), on AMX tiles (its prompt path where the CPU has them: `amx_kernel.h`), by oneDNN's product expert
by expert (its prompt path before the panel kernel), and by the small-row kernel on all pairs. The ways take turns
round by round (this host's speed drifts between minutes); GFLOP/s counts the experts' products only. Every way's
output is checked against the expert-by-expert one.

Then vLLM's own kernel for the same layer (`cpu_fused_moe`, float32, in .venv-vllm: vllm_moe_worker.py) against the
panel kernel, the two taking turns in that one process on the same weights and routing, the router left out of both
(so its column is the experts and their weighted sum only)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from common import REPO, VLLM_PYTHON, machine_info, median_ms_each, write_json
from hybridspec.model import layers

SHAPES = {  # name: (model class, its config)
    "qwen3-moe": ("Qwen3MoeForCausalLM", lambda: transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=1024, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4,
        head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, norm_topk_prob=True,
        initializer_range=0.02)),
    "gpt-oss": ("GptOssForCausalLM", lambda: transformers.GptOssConfig(
        vocab_size=1000, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4, initializer_range=0.02)),
}


def moe_layers(model_class: str, config) -> dict[str, layers._MixtureOfExperts]:
    """The layer's MoE block each way: panel kernel, AMX tiles (where this CPU has them), oneDNN expert by expert,
    small-row kernel on every pair."""
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for p in model.parameters():  # gpt-oss leaves its experts' weights uninitialised
            p.copy_(p.normal_(0, 0.02).to(torch.bfloat16))
    block = model.model.layers[0].mlp
    amx_pack, layers.amx_pack = layers.amx_pack, lambda weight: None
    try:
        panels = layers._MixtureOfExperts(block, config, pack=True)  # the panel kernel, AMX or not
    finally:
        layers.amx_pack = amx_pack
    kernel_rows, layers.KERNEL_ROWS = layers.KERNEL_ROWS, 0
    try:
        onednn = layers._MixtureOfExperts(block, config, pack=True)  # no kernels: oneDNN's packed experts
    finally:
        layers.KERNEL_ROWS = kernel_rows
    ways = {"panel kernel": panels, "oneDNN expert by expert": onednn, "small-row kernel": panels}
    amx = layers._MixtureOfExperts(block, config, pack=True)
    return ways if amx.amx is None else {"AMX tiles": amx, **ways}


def run(name: str, tokens: int, repeats: int, vllm: bool) -> dict:
    model_class, make_config = SHAPES[name]
    config = make_config()
    ways = moe_layers(model_class, config)
    torch.manual_seed(1)
    x = torch.randn(tokens, config.hidden_size) * 0.5
    residual = torch.zeros_like(x)

    def call(way: str):
        moe = ways[way]

        def plus():
            pairs = layers.EXPERT_KERNEL_PAIRS
            layers.EXPERT_KERNEL_PAIRS = 10 ** 9 if way == "small-row kernel" else pairs
            try:
                return moe.plus(x, residual)
            finally:
                layers.EXPERT_KERNEL_PAIRS = pairs
        return plus

    calls = {way: call(way) for way in ways}
    with torch.inference_mode():
        reference = calls["oneDNN expert by expert"]()
        for way, fn in calls.items():
            torch.testing.assert_close(fn(), reference, atol=1e-5, rtol=1e-4, msg=f"{name}: {way} differs")
        ms = median_ms_each(calls, repeats)
    gate_up, _, down, _ = ways["panel kernel"].stacked
    flops = 2 * tokens * config.num_experts_per_tok * (gate_up[0].numel() + down[0].numel())
    row = {"model": name, "tokens": tokens, "expert_gflop": flops / 1e9,
           "ms": ms, "expert_gflop_per_s": {way: flops / (t / 1e3) / 1e9 for way, t in ms.items()}}
    row["panel_speedup_vs_onednn"] = ms["oneDNN expert by expert"] / ms["panel kernel"]
    if "AMX tiles" in ms:
        row["amx_speedup_vs_panel"] = ms["panel kernel"] / ms["AMX tiles"]
    if vllm:
        row["vllm"] = vllm_turns(ways["panel kernel"], x, repeats)
    return row


def vllm_turns(moe: layers._MixtureOfExperts, x: torch.Tensor, repeats: int) -> dict:
    """vLLM's fused-MoE kernel and the panel kernel on this layer's experts and routing, in turns in .venv-vllm
    (vllm_moe_worker.py): their median ms and largest difference, or why it did not run."""
    if not VLLM_PYTHON.exists():
        return {"error": f"{VLLM_PYTHON} is missing (scripts/setup_vllm.sh makes it)"}
    with torch.inference_mode():
        weights, chosen = moe.route(x)
    gate_up, gate_up_bias, down, down_bias = moe.stacked
    gate_up, down = gate_up.float(), down.float()  # a step's compact copies widen exactly (`compact_weights`)
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        path = Path(tmp) / "layer.pt"
        torch.save({"x": x, "weights": weights, "chosen": chosen, "top_k": moe.top_k, "clamp": moe.clamp,
                    "gate_up": gate_up, "gate_up_bias": gate_up_bias, "down": down, "down_bias": down_bias}, path)
        job = {"tensors": str(path), "repeats": repeats, "threads": torch.get_num_threads()}
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(job["threads"])}
        done = subprocess.run([str(VLLM_PYTHON), str(REPO / "benchmarks" / "vllm_moe_worker.py"), json.dumps(job)],
                              env=env, text=True, capture_output=True, timeout=1800)
    for line in done.stdout.splitlines():
        kind, _, payload = line.partition(" ")
        if kind in ("@@result", "@@error"):
            return json.loads(payload)
    return {"error": f"the worker exited {done.returncode}: {done.stderr.strip()[-300:]}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens in the chunk")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                        help="also vLLM's fused-MoE kernel against the panel kernel (in .venv-vllm)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := set(models) - set(SHAPES):
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    if not layers.KERNEL_ROWS:
        parser.error("the product kernels need an AVX-512 CPU; this one runs the experts expert by expert only")
    torch.set_num_threads(args.threads)
    rows = [run(name, args.tokens, args.repeats, args.vllm) for name in models]
    print(f"\n{args.tokens}-token chunk, float32, {args.threads} threads; ms for the MoE block (experts' GFLOP/s)\n")
    ways = list(rows[0]["ms"])
    amx = "AMX tiles" in ways
    print("| model | expert GFLOP | " + " | ".join(ways) + " | panel vs oneDNN |" + (" AMX vs panel |" if amx else ""))
    print("|---|---|" + "---|" * (len(ways) + 1 + amx))
    for row in rows:
        cells = [f"{row['ms'][w]:.1f} ({row['expert_gflop_per_s'][w]:.0f})" for w in ways]
        print(f"| {row['model']} | {row['expert_gflop']:.2f} | " + " | ".join(cells)
              + f" | **{row['panel_speedup_vs_onednn']:.2f}x** |"
              + (f" **{row['amx_speedup_vs_panel']:.2f}x** |" if amx else ""))
    if args.vllm:
        print("\nvLLM's fused-MoE kernel against the panel kernel, in turns in one process (experts and their sum,"
              " ms)\n")
        print("| model | vLLM fused MoE | panel kernel | vLLM's time over ours | largest difference |")
        print("|---|---|---|---|---|")
        for row in rows:
            got = row["vllm"]
            if "error" in got:
                print(f"| {row['model']} | {got['error'][:120]} | | | |")
                continue
            theirs, ours = got["ms"]["vLLM fused MoE"], got["ms"]["panel kernel"]
            print(f"| {row['model']} | {theirs:.1f} | {ours:.1f} | **{theirs / ours:.2f}x** | "
                  f"{got['max_abs_diff']:.1e} |")
    write_json(args.json, {"args": vars(args), "machine": machine_info(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
