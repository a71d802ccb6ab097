"""The attention of a decode or verification step on this CPU: hybridspec's kernel (`hybridspec/attention_kernel.h`)
against PyTorch's flash attention, which the target ran before it (prompt chunks: `bench_prefill.py`).

One step of a SmolLM2-shaped model (30 layers, 3 KV heads of 64 dims, 3 query heads per KV head, float32): for
each context length and number of step queries q (1: a plain step; more: a draft of q - 1 tokens, a chain), the ms
of all 30 layers' attention, each layer over its own KV cache (as in a step: every layer's keys come from memory).
`bound_ms` is the time to read the keys and values once at `--bandwidth` GB/s (a single core's streaming rate,
measured here with a sum over 256 MB unless given).

    python benchmarks/bench_attention.py --json out/bench_attention.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common import machine_info, median_ms_each, streaming_gb_s, write_json

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def measure(contexts: list[int], queries: list[int], layers: int, kv_heads: int, group: int, dim: int,
            repeats: int, bandwidth: float) -> list[dict]:
    from hybridspec.model import _attention

    rows = []
    gen = torch.Generator().manual_seed(0)
    for context in contexts:
        capacity = context + max(queries) + 16
        keys = [torch.randn(1, kv_heads, capacity, dim, generator=gen) for _ in range(layers)]
        values = [torch.randn(1, kv_heads, capacity, dim, generator=gen) for _ in range(layers)]
        for q in queries:
            query = torch.randn(1, kv_heads, group * q, dim, generator=gen)
            out, kv = torch.empty_like(query), context + q
            see = torch.ones(1, q, q, dtype=torch.uint8).tril().contiguous()
            prefix = torch.tensor([context])
            scores = torch.empty(torch.get_num_threads(), group * q * (kv + 16))
            mask = torch.zeros(1, 1, group * q, kv)  # the additive mask the target built for flash attention
            mask[..., context:] = torch.where(see[0].bool(), 0.0, float("-inf")).repeat(group, 1)

            def kernel():
                for k, v in zip(keys, values):
                    _attention.decode_attention(
                        query.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), scores.data_ptr(),
                        scores.shape[1], 1, kv_heads, group * q, dim, q, prefix.data_ptr(), see.data_ptr(), 0,
                        k.stride(0), k.stride(1), k.stride(2), dim ** -0.5, scores.shape[0])

            def flash():
                for k, v in zip(keys, values):
                    FLASH(query, k[:, :, :kv], v[:, :, :kv], attn_mask=mask if q > 1 else None)

            ms = median_ms_each({"kernel": kernel, "flash": flash}, repeats=repeats)
            bytes_read = 2 * layers * kv_heads * kv * dim * 4
            rows.append({"context": context, "queries": q, "kernel_ms": round(ms["kernel"], 3),
                         "flash_ms": round(ms["flash"], 3), "speedup": round(ms["flash"] / ms["kernel"], 3),
                         "bound_ms": round(bytes_read / bandwidth / 1e6, 3)})
            r = rows[-1]
            print(f"{context:>8} {q:>8} {r['flash_ms']:>10.2f} {r['kernel_ms']:>10.2f} {r['speedup']:>8.2f}x "
                  f"{r['bound_ms']:>9.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="512,2048,4096,8192")
    parser.add_argument("--queries", default="1,2,3,5,9,17,33", help="step inputs per cache: 1 + draft tokens")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bandwidth", type=float, help="GB/s for bound_ms (default: measured)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from hybridspec.model import _attention

    if not _attention.supported():
        print("this CPU has no AVX-512F: the target runs PyTorch's attention, nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    bandwidth = args.bandwidth or streaming_gb_s()
    print(f"one step's attention over {args.layers} layers, {args.kv_heads} KV heads x {args.group} query heads of "
          f"{args.head_dim} dims, float32; memory {bandwidth:.1f} GB/s")
    print(f"{'context':>8} {'queries':>8} {'flash ms':>10} {'kernel ms':>10} {'speedup':>9} {'bound ms':>9}")
    rows = measure([int(c) for c in args.contexts.split(",")], [int(q) for q in args.queries.split(",")],
                   args.layers, args.kv_heads, args.group, args.head_dim, args.repeats, bandwidth)
    write_json(args.json, {"rows": rows, "bandwidth_gb_s": round(bandwidth, 2), "machine": machine_info(),
                           "shape": {"layers": args.layers, "kv_heads": args.kv_heads, "group": args.group,
                                     "head_dim": args.head_dim}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
