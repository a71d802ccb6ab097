"""vLLM's side of benchmarks/bench_moe_block.py, run by .venv-vllm/bin/python with the repository on PYTHONPATH: one
MoE layer's experts on a prompt chunk by vLLM's CPU fused-MoE kernel (`cpu_fused_moe`, its float32 "vec" path, what
vLLM runs for an unquantized MoE on this CPU) and by the engine's panel kernel, taking turns in this one process, on
the same weights and the same routing.

argv[1] is a JSON object {"tensors": PATH, "repeats": R, "threads": T}; PATH holds what the parent saved: x, the
router's weights and chosen experts, the experts' stacked weights [E, out, in] (gate_up: gate rows, then up rows),
biases, top_k, and gpt-oss's clamp (alpha, limit) or None. Prints `@@result {"ms": {...}, "max_abs_diff": ...}`
(the median ms of each way, the router left out of both) or `@@error {"error": ...}` and exits 3.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

MARK = "@@"


def reply(kind: str, payload: dict) -> None:
    print(f"{MARK}{kind} {json.dumps(payload)}", flush=True)


def main() -> int:
    job = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(job["threads"])
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # noqa: BLE001 (a vLLM build without its CPU kernels)
        reply("error", {"error": f"{type(e).__name__}: {e}"[:400]})
        return 3
    from hybridspec.model import layers

    t = torch.load(job["tensors"])
    x, weights, chosen, clamp = t["x"], t["weights"], t["chosen"], t["clamp"]
    gate_up, gate_up_bias, down, down_bias = t["gate_up"], t["gate_up_bias"], t["down"], t["down_bias"]
    if clamp is not None and tuple(clamp) != (1.702, 7.0):
        reply("error", {"error": f"vLLM's swigluoai has alpha 1.702 and limit 7.0 built in, not {clamp}"})
        return 3

    # the engine's prompt-chunk path on these weights: the layer's state without a transformers block to build it from
    ours = object.__new__(layers._MixtureOfExperts)
    ours.kernel, ours.top_k, ours.clamp, ours.experts = True, t["top_k"], clamp, [None] * gate_up.shape[0]
    ours.stacked = (gate_up, gate_up_bias, down, down_bias)
    ours.panels = (layers.pack_panels(gate_up, gated=True), layers.pack_panels(down))
    ours.gate_up_bias_panels = None if gate_up_bias is None else layers.gated_order(gate_up_bias)
    ours.amx = None  # the panel kernel, whatever this CPU has

    # vLLM's layout: w13 [E, 2I, H], gate then up for SiLU; gpt-oss's swigluoai wants them interleaved (gate, up, ...)
    units = gate_up.shape[1] // 2
    w13, b13 = gate_up, gate_up_bias
    if clamp is not None:
        order = torch.stack([torch.arange(units), torch.arange(units, 2 * units)], dim=1).reshape(-1)
        w13, b13 = gate_up[:, order].contiguous(), None if gate_up_bias is None else gate_up_bias[:, order].contiguous()
    packed13, packed2 = ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(down, "vec")
    ids, topk_weights = chosen.to(torch.int32).contiguous(), weights.float().contiguous()
    activation = "silu" if clamp is None else "swigluoai"

    def vllm_way() -> torch.Tensor:
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, packed13, packed2, b13, down_bias, topk_weights, ids, activation, "vec")
        return out

    def panel_way() -> torch.Tensor:
        return ours.experts_sum(x, weights, chosen)

    ways = {"vLLM fused MoE": vllm_way, "panel kernel": panel_way}
    with torch.inference_mode():
        diff = float((vllm_way() - panel_way()).abs().max())
        times: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(job["repeats"] + 2):  # two rounds warm up; the ways take turns
            for way, fn in ways.items():
                start = time.perf_counter()
                fn()
                if round_ >= 2:
                    times[way].append((time.perf_counter() - start) * 1000)
    reply("result", {"ms": {way: statistics.median(ts) for way, ts in times.items()}, "max_abs_diff": diff})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
