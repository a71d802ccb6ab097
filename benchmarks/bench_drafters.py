"""Model drafters on this machine: drafting latency for K = 1..8 (P-EAGLE's single pass vs EAGLE-3's K passes, and the
LSTM), and acceptance length at K = 3, 5, 7 of the trained SmolLM2 heads on held-out chat and agent text.

    python benchmarks/bench_drafters.py [--json PATH] [--context 512] [--repeats 20] [--threads 1]

Latency: SmolLM2-135M-shaped drafters (the trained checkpoints' shapes when they exist; timing does not depend on the
weights), a drafter state holding `--context` real slots, then per step: accept 2 new rows (one accepted draft and the
bonus token, as after a typical verification) and propose K. Median milliseconds per step.
Acceptance: each checkpoint in speculators/checkpoints/ on the held-out split of its recipe's feature cache (never
trained on), greedy, offline (see hybridspec.speculators.train.trainer.evaluate_acceptance); chat = MT-Bench and
HumanEval prompts, agent = user turns of the dev agent traces. Needs `hybridspec train RECIPE --data-only` to have run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hybridspec.speculators import (Eagle3Drafter, EagleConfig, LayerConfig, LSTMConfig, LSTMDrafter, PEagleDrafter,
                                    TargetFeatures, TargetInfo, load_drafter)
from hybridspec.speculators.formats import read_config
from hybridspec.speculators.train import FeatureStore, load_recipe
from hybridspec.speculators.train.data import load_target_head
from hybridspec.speculators.train.trainer import evaluate_acceptance

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"peagle": "peagle-smollm2", "eagle3": "eagle3-smollm2", "lstm": "lstm-smollm2"}
# SmolLM2-135M-Instruct
TARGET = dict(hidden=576, vocab=49152, layers=30, heads=9, kv_heads=3, intermediate=1536, rope_theta=100000.0)


def checkpoint_dir(kind: str) -> Path:
    return ROOT / "speculators" / "checkpoints" / RECIPES[kind]


def shaped_drafter(kind: str) -> torch.nn.Module:
    """A drafter with the trained checkpoint's shape (or the recipe's), random weights."""
    ckpt = checkpoint_dir(kind)
    if (ckpt / "config.json").exists():
        config = read_config(ckpt)
        if kind == "lstm":
            return LSTMDrafter(LSTMConfig(TARGET["hidden"], int(config["inner_dim"]), TARGET["vocab"],
                                          int(config["n_predict"]))).eval()
        layers, inter, vocab = (config["transformer_layer_config"]["num_hidden_layers"],
                                config["transformer_layer_config"]["intermediate_size"], config["draft_vocab_size"])
    else:
        arch = load_recipe(ROOT / "speculators" / "recipes" / f"{RECIPES[kind]}.yaml").architecture
        if kind == "lstm":
            return LSTMDrafter(LSTMConfig(TARGET["hidden"], arch.dim, TARGET["vocab"], arch.n_predict)).eval()
        layers, inter, vocab = arch.num_layers, arch.intermediate_size, arch.draft_vocab_size
    layer = LayerConfig(hidden_size=TARGET["hidden"], intermediate_size=inter, num_attention_heads=TARGET["heads"],
                        num_key_value_heads=TARGET["kv_heads"], head_dim=TARGET["hidden"] // TARGET["heads"],
                        rope_theta=TARGET["rope_theta"])
    config = EagleConfig(layer=layer, num_layers=layers, target_hidden_size=TARGET["hidden"],
                         target_vocab_size=TARGET["vocab"], draft_vocab_size=vocab,
                         aux_layer_ids=(2, TARGET["layers"] // 2, TARGET["layers"] - 3), mask_token_id=0)
    cls = PEagleDrafter if kind == "peagle" else Eagle3Drafter
    return cls(config, embed_tokens=torch.randn(TARGET["vocab"], TARGET["hidden"]) * 0.02).eval()


def random_features(n: int) -> TargetFeatures:
    return TargetFeatures(torch.randn(n, 3 * TARGET["hidden"]), torch.randn(n, TARGET["hidden"]))


def drafting_latency(kind: str, context: int, repeats: int) -> dict[int, float]:
    """Median ms per drafting step for K = 1..8. The K values take turns within each repeat, so a burst of load from
    other processes on this shared CPU hits them all alike."""
    drafter = shaped_drafter(kind)
    states = {}
    for k in range(1, 9):
        states[k] = drafter.begin(random_features(context), torch.randint(0, TARGET["vocab"], (context,)))
        drafter.propose(states[k], k)  # the prompt's pass is a prefill cost, not a drafting step
    times: dict[int, list[float]] = {k: [] for k in states}
    for _ in range(repeats + 2):
        for k, state in states.items():
            drafter.accept(state, random_features(2), torch.randint(0, TARGET["vocab"], (2,)))
            start = time.perf_counter()
            drafter.propose(state, k)
            times[k].append(time.perf_counter() - start)
    return {k: 1000 * statistics.median(t[2:]) for k, t in times.items()}


def acceptance(kind: str) -> dict[str, dict] | None:
    ckpt = checkpoint_dir(kind)
    if not (ckpt / "config.json").exists():
        return None
    recipe = load_recipe(ROOT / "speculators" / "recipes" / f"{RECIPES[kind]}.yaml")
    root = recipe.feature_dir()
    store = FeatureStore(root, "heldout")
    embed, _ = load_target_head(root)
    meta = store.meta
    drafter = load_drafter(ckpt, target=TargetInfo(meta["num_layers"], meta["hidden_size"], meta["vocab_size"]),
                           embed_tokens=embed, aux_layer_ids=meta["aux_layer_ids"])
    kinds = {"chat": ("mt_bench", "humaneval"), "agent": ("agent_traces",)}
    result = {}
    for name, prefixes in kinds.items():
        indices = [i for i, s in enumerate(store.sources) if s.split(":")[0] in prefixes]
        if indices:
            result[name] = evaluate_acceptance(drafter, store, [3, 5, 7], indices, slots_per_batch=256)
    log = ckpt / "train_log.json"
    if log.exists():
        result["train_seconds"] = json.loads(log.read_text()).get("train_seconds")
    result["checkpoint_mb"] = round((ckpt / "model.safetensors").stat().st_size / 2**20, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--context", type=int, default=512, help="real slots already in the drafter's cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"context": args.context, "threads": args.threads, "latency_ms": {}, "acceptance": {}}
    with torch.inference_mode():
        for kind in RECIPES:
            results["latency_ms"][kind] = drafting_latency(kind, args.context, args.repeats)
    print(f"drafting latency, ms per step (context {args.context}, {args.threads} thread(s), median of {args.repeats})")
    print(f"{'K':>3} " + " ".join(f"{kind:>9}" for kind in RECIPES))
    for k in range(1, 9):
        print(f"{k:>3} " + " ".join(f"{results['latency_ms'][kind][k]:9.2f}" for kind in RECIPES))
    for kind in RECIPES:
        lat = results["latency_ms"][kind]
        results[f"{kind}_k7_over_k1"] = round(lat[7] / lat[1], 3)
        print(f"{kind}: K=7 costs {lat[7] / lat[1]:.2f}x its K=1")
    for kind in RECIPES:
        results["acceptance"][kind] = acceptance(kind)
    print("\nacceptance length (tokens per step, greedy) on held-out text")
    print(f"{'drafter':>8} {'text':>6} {'K=3':>6} {'K=5':>6} {'K=7':>6} {'steps@7':>8}")
    for kind, res in results["acceptance"].items():
        if res is None:
            print(f"{kind:>8}  (no checkpoint in {checkpoint_dir(kind).relative_to(ROOT)})")
            continue
        for text in ("chat", "agent"):
            if text in res:
                r = res[text]
                print(f"{kind:>8} {text:>6} {r['acceptance@3']:6.2f} {r['acceptance@5']:6.2f} {r['acceptance@7']:6.2f} "
                      f"{r['steps'][7]:8d}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
