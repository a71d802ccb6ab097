"""The accelerator checks of `hybridspec gpu-run`, each recorded in the run's figures JSON.

- verifier kernels: the Triton kernels of `verifier/` against the torch reference on the same random inputs
  (greedy walk, rejection walk with draft probabilities and deterministic drafts, the sampler, `verify_batch` with both
  backends), at realistic sizes on CUDA; on a CPU under TRITON_INTERPRET=1 at tiny sizes. Timings of both.
- verification cost: ms of one target pass of 1 + k tokens over a warm KV cache of C tokens (transformers, eager),
  SmolLM2 and, at full scale, a random Llama-3.1-8B-shaped target in bfloat16 (timing does not depend on weights).
- drafter latency: each head's drafting pass for K drafts (the training-time chain computation: C real slots and a
  K-deep chain from the last, one forward), ms.

Run as `python -m hybridspec.tools.gpu_checks --json OUT [--tiny] [--target DIR] [--heads DIR,...]` (gpu-run runs it
in a subprocess under a time limit, with TRITON_INTERPRET=1 on a CPU, which must be set before triton is imported).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from hybridspec.tools.gpu_weights import checkout_imports

LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192}


def timed(fn: Callable[[], Any], repeats: int, device: Any) -> float:
    """Median ms of fn() over repeats (after one warm-up), synchronising an accelerator around each call."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return round(statistics.median(times), 4)


def _trees(batch: int, num_draft: int, vocab: int, seed: int, device: Any):
    import torch

    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([[i - 1 if b % 2 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(num_draft)]
                            for b in range(batch)], dtype=torch.int32)
    tokens = torch.randint(0, 3, (batch, num_draft), generator=g, dtype=torch.int32)
    num_nodes = torch.randint(0, num_draft + 1, (batch,), generator=g, dtype=torch.int32)
    num_nodes[0] = num_draft
    return tokens.to(device), parents.to(device), num_nodes.to(device), g


def verifier_kernels(device: Any, sizes: list[tuple[int, int, int]], repeats: int) -> list[dict[str, Any]]:
    import torch

    from hybridspec.proposal import Proposal
    from hybridspec.verifier import kernels, process_logits, reference, verify_batch

    out = []
    for batch, num_draft, vocab in sizes:
        row: dict[str, Any] = {"batch": batch, "num_draft": num_draft, "vocab": vocab}
        tokens, parents, num_nodes, g = _trees(batch, num_draft, vocab, 0, device)
        bias = torch.zeros(vocab)
        bias[:3] = 4.0
        argmax = (torch.rand(batch, num_draft + 1, generator=g) < 0.3).int().to(device)
        target = process_logits((torch.randn(batch, num_draft + 1, vocab, generator=g) + bias).to(device), 0.9, 20)
        draft = process_logits((torch.randn(batch, num_draft, vocab, generator=g) + bias).to(device), 0.9, 20)
        uniforms = torch.rand(batch, num_draft, generator=g).to(device)
        cases = {"greedy_walk": (argmax, tokens, parents, num_nodes),
                 "rejection_walk": (target, draft, tokens, parents, num_nodes, uniforms),
                 "rejection_walk_deterministic": (target, None, tokens, parents, num_nodes, uniforms)}
        for name, args in cases.items():
            fn = name.replace("_deterministic", "")
            got, want = getattr(kernels, fn)(*args), getattr(reference, fn)(*args)
            same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got[:4], want[:4]))
            if fn == "rejection_walk":
                used = want[3].bool()
                same = same and torch.allclose(got[4][used], want[4][used], rtol=1e-6, atol=1e-9)
            row[name] = {"equal": bool(same), "triton_ms": timed(lambda: getattr(kernels, fn)(*args), repeats, device),
                         "torch_ms": timed(lambda: getattr(reference, fn)(*args), repeats, device)}
        final_row = torch.randint(0, num_draft + 1, (batch,), generator=g, dtype=torch.int32).to(device)
        use_residual = (torch.arange(batch) % 2).int().to(device)
        residual = torch.rand(batch, vocab, generator=g).to(device)
        race = torch.empty(batch, vocab).exponential_(generator=g).reciprocal_().to(device)
        args = (target, final_row, use_residual, residual, race)
        row["race_sample"] = {"equal": bool(torch.equal(kernels.race_sample(*args), reference.race_sample(*args))),
                              "triton_ms": timed(lambda: kernels.race_sample(*args), repeats, device),
                              "torch_ms": timed(lambda: reference.race_sample(*args), repeats, device)}
        logits = [(torch.randn(num_draft + 1, vocab, generator=g) + bias).to(device) for _ in range(batch)]
        proposals = [Proposal(token_ids=tokens[b].tolist(), parents=parents[b].tolist(),
                              draft_logits=(torch.randn(num_draft, vocab, generator=g) + bias).to(device)
                              if b % 2 else None) for b in range(batch)]
        for params in ((0.0, 0, 1.0), (0.7, 50, 0.9)):
            results = [verify_batch(logits, proposals, *params, backend=backend,
                                    generator=torch.Generator(device).manual_seed(7))
                       for backend in ("triton", "torch")]
            row[f"verify_batch_t{params[0]}"] = {"equal": results[0] == results[1]}
        out.append(row)
    return out


def verify_cost(model: Any, contexts: list[int], ks: list[int], repeats: int) -> dict[str, Any]:
    """ms of one pass of 1 + k tokens over a warm cache of C tokens, per C and k."""
    import torch
    from transformers import DynamicCache

    device = model.get_output_embeddings().weight.device
    vocab = model.config.vocab_size
    table: dict[str, Any] = {}
    with torch.inference_mode():
        for context in contexts:
            cache = DynamicCache()
            prompt = torch.randint(0, vocab, (1, context), device=device)
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            row = {}
            for k in ks:
                new = torch.randint(0, vocab, (1, 1 + k), device=device)

                def step() -> None:
                    model(input_ids=new, past_key_values=cache, use_cache=True, logits_to_keep=1 + k)
                    cache.crop(-(1 + k))  # the negative form works across transformers versions

                row[str(1 + k)] = timed(step, repeats, device)
            table[str(context)] = row
    return {"ms_by_context_and_tokens": table,
            "ratio_to_one_token": {c: {n: round(ms / row["1"], 3) for n, ms in row.items()}
                                   for c, row in table.items()}}


def drafter_latency(drafter: Any, context: int, k: int, repeats: int) -> float:
    """ms of one drafting pass for k drafts: `context` real slots and a k-deep chain from slot context - k (EAGLE-3's
    training-time test reads the real next token at origin + depth, which must be a slot)."""
    import torch

    from hybridspec.speculators.chains import ChainLayout

    device = next(drafter.parameters()).device
    aux = torch.randn(context, drafter.fc.in_features, device=device, dtype=next(drafter.parameters()).dtype)
    tokens = torch.randint(0, drafter.config.target_vocab_size, (context,), device=device)
    last = torch.tensor([context - k], device=device)
    layout = ChainLayout(torch.zeros(context, dtype=torch.long, device=device), torch.arange(context, device=device),
                         [torch.arange(context, device=device)] + [last] * (k - 1))
    with torch.inference_mode():
        return timed(lambda: drafter.chain_logits(aux, tokens, layout), repeats, device)


def head_latencies(heads: list[Path], device: Any, contexts: list[int], repeats: int,
                   dtype: Any = None) -> dict[str, Any]:
    """Each head's drafting pass over `contexts` slots, in `dtype` (bfloat16 on CUDA, else float32 by default)."""
    import torch

    from hybridspec.speculators.eagle import EagleBase
    from hybridspec.speculators.formats import load_drafter, read_config

    out: dict[str, Any] = {}
    for path in heads:
        # a trained head beside its kind's shipped one keeps its own entry
        name = path.name if path.name not in out else f"{path.parent.name}/{path.name}"
        try:
            config = read_config(path)
            embed = torch.zeros(config.get("transformer_layer_config", {}).get("vocab_size", 49152),
                                config.get("transformer_layer_config", {}).get("hidden_size", 576))
            drafter = load_drafter(path, embed_tokens=embed, device=device, dtype=dtype or (
                torch.bfloat16 if device.type == "cuda" else torch.float32))
            if not isinstance(drafter, EagleBase):
                out[name] = {"skipped": "not an EAGLE-family head (the LSTM drafts from the last position only)"}
                continue
            k = drafter.num_speculative_tokens if drafter.name != "fasteagle" else len(drafter.layers)
            out[name] = {"k": k, **{f"ms@{c}": drafter_latency(drafter, c, k, repeats) for c in contexts}}
        except Exception as e:  # one head's failure is recorded, the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run_checks(tiny: bool, target: str | None, heads: list[Path]) -> dict[str, Any]:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "scale": "tiny" if tiny else "full"}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 2)
        print(f"[checks] {name}: {time.perf_counter() - start:.1f} s", flush=True)

    try:
        import triton  # noqa: F401

        sizes = [(3, 4, 37), (2, 3, 300)] if tiny else [(64, 16, 49152), (64, 16, 128256), (256, 8, 49152)]
        attempt("verifier_kernels", lambda: verifier_kernels(device, sizes, 1 if tiny else 10))
    except ImportError as e:
        result["verifier_kernels"] = {"skipped": f"triton is not installed ({e})"}
    if target:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
        contexts, ks = ([16], [0, 1, 3]) if tiny else ([512, 2048], [0, 1, 2, 3, 4, 5, 7, 9, 12, 16, 24, 32, 48, 64])
        attempt("verify_cost_target", lambda: verify_cost(model, contexts, ks, 2 if tiny else 10))
        del model
    else:
        result["verify_cost_target"] = {"skipped": "no target weights staged"}
    if tiny:
        result["verify_cost_llama8b_shape"] = {"skipped": "tiny scale (a random 8B-shaped model is for the GPU)"}
    elif device.type != "cuda":
        result["verify_cost_llama8b_shape"] = {"skipped": "no CUDA device"}
    else:
        def big() -> dict[str, Any]:
            from transformers import AutoModelForCausalLM, LlamaConfig

            with torch.device(device):
                model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_8B), dtype=torch.bfloat16).eval()
            try:
                return verify_cost(model, [2048], [0, 1, 3, 5, 7, 15, 31, 63], 5)
            finally:
                del model
                torch.cuda.empty_cache()
        attempt("verify_cost_llama8b_shape", big)
    if heads:
        attempt("drafter_latency", lambda: head_latencies(heads, device, [16] if tiny else [16, 256, 1024],
                                                         2 if tiny else 20))
    else:
        result["drafter_latency"] = {"skipped": "no heads given (gpu-run times the heads it trains after training)"}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where the results go")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--target", default=None, help="Hugging Face directory of the target (verification cost)")
    parser.add_argument("--heads", default="", help="comma-separated drafter checkpoint directories (latency)")
    args = parser.parse_args(argv)
    heads = [Path(h) for h in args.heads.split(",") if h]
    result = run_checks(args.tiny, args.target, heads)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    checkout_imports()
    sys.exit(main())
