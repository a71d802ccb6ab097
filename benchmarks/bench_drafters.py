"""Model drafters on this machine: drafting latency for K = 1..8 (P-EAGLE's and FastEagle's single pass vs EAGLE-3's K
passes, and the LSTM), and acceptance length at K = 3, 5, 7 of the trained SmolLM2 heads on held-out chat and agent
text.

    python benchmarks/bench_drafters.py [--json PATH] [--context 512] [--repeats 20] [--threads 1]
    python benchmarks/bench_drafters.py --shape llama3-8b --device cuda --json PATH     # on a GPU machine
    python benchmarks/bench_drafters.py --extra no-cascade=out/ablations/fasteagle-no-cascade ...  # more checkpoints

Latency: drafters shaped for SmolLM2-135M (the trained checkpoints' shapes when they exist; timing does not depend on
the weights) or, with --shape llama3-8b, for Llama-3.1-8B (hidden 4096, vocabulary 128,256, draft vocabulary 32k,
P-EAGLE with 4 layers as published, EAGLE-3 with 1, the LSTM with 4096 inner dim), random weights; a drafter state
holding `--context` real slots, then per step: accept 2 new rows (one accepted draft and the bonus token, as after a
typical verification) and propose K. Median milliseconds per step. On CPU the linears run on oneDNN-packed weights, as
the engine runs them (hybridspec.model.linear.pack_linears), multiplying in bfloat16 where the CPU does so natively
(--cpu-matmul float32 to compare).
Acceptance: each checkpoint in speculators/checkpoints/ on the held-out split of its recipe's feature cache (never
trained on), greedy, offline (see hybridspec.speculators.train.evaluation.evaluate_acceptance), for chains and for the
engine's default trees (every node verified); chat = MT-Bench and HumanEval prompts, agent = user turns of the dev
agent traces, self-instruct = requests the target wrote itself. Needs `hybridspec train RECIPE --data-only` to have
run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import REPO, machine_info, median_ms_each, write_json
from hybridspec.speculators import (EagleConfig, LayerConfig, LSTMConfig, LSTMDrafter, TargetFeatures, TargetInfo,
                                    load_drafter)
from hybridspec.speculators.formats import read_config, weights_file
from hybridspec.speculators.registry import drafter_kind
from hybridspec.speculators.train import FeatureStore, load_recipe
from hybridspec.speculators.train.data import load_target_head
from hybridspec.speculators.train.evaluation import evaluate_acceptance
from hybridspec.model.linear import fast_bf16, pack_linears

RECIPES = {"fasteagle": "fasteagle-smollm2", "peagle": "peagle-smollm2", "eagle3": "eagle3-smollm2",
           "lstm": "lstm-smollm2"}
SHAPES = {
    "smollm2": dict(hidden=576, vocab=49152, layers=30, heads=9, kv_heads=3, intermediate=1536, rope_theta=100000.0),
    "llama3-8b": dict(hidden=4096, vocab=128256, layers=32, heads=32, kv_heads=8, intermediate=14336,
                      rope_theta=500000.0, draft_vocab=32000, peagle_layers=4, eagle3_layers=1, fasteagle_layers=7,
                      lstm_dim=4096, n_predict=3),
}
TARGET = SHAPES["smollm2"]  # the shape of the target the shipped heads serve
TREE_WIDTH = 3  # the engine's default trees: the greedy chain and two runner-ups per depth (DrafterProposer)


def checkpoint_dir(kind: str) -> Path:
    return EXTRA.get(kind) or REPO / "speculators" / "checkpoints" / RECIPES[kind]


EXTRA: dict[str, Path] = {}  # --extra NAME=DIR: more checkpoints (ablations), measured like the shipped ones


def shaped_drafter(kind: str, shape: str = "smollm2") -> torch.nn.Module:
    """A drafter with the trained checkpoint's shape (or the recipe's), or the `shape`'s, random weights."""
    target = SHAPES[shape]
    ckpt = checkpoint_dir(kind)
    if kind in EXTRA:
        return load_drafter(ckpt, embed_tokens=torch.randn(target["vocab"], target["hidden"]) * 0.02).eval()
    if shape != "smollm2":
        if kind == "lstm":
            return LSTMDrafter(LSTMConfig(target["hidden"], target["lstm_dim"], target["vocab"],
                                          target["n_predict"])).eval()
        layers, inter, vocab = target[f"{kind}_layers"], target["intermediate"], target["draft_vocab"]
    elif (ckpt / "config.json").exists():
        config = read_config(ckpt)
        if kind == "lstm":
            return LSTMDrafter(LSTMConfig(TARGET["hidden"], int(config["inner_dim"]), TARGET["vocab"],
                                          int(config["n_predict"]))).eval()
        layers, inter, vocab = (config["transformer_layer_config"]["num_hidden_layers"],
                                config["transformer_layer_config"]["intermediate_size"], config["draft_vocab_size"])
    else:
        arch = load_recipe(REPO / "speculators" / "recipes" / f"{RECIPES[kind]}.yaml").architecture
        if kind == "lstm":
            return LSTMDrafter(LSTMConfig(TARGET["hidden"], arch.dim, TARGET["vocab"],
                                          arch.num_speculative_tokens)).eval()
        layers, inter, vocab = arch.num_layers, arch.intermediate_size, arch.draft_vocab_size
    layer = LayerConfig(hidden_size=target["hidden"], intermediate_size=inter, num_attention_heads=target["heads"],
                        num_key_value_heads=target["kv_heads"], head_dim=target["hidden"] // target["heads"],
                        rope_theta=target["rope_theta"])
    config = EagleConfig(layer=layer, num_layers=layers, target_hidden_size=target["hidden"],
                         target_vocab_size=target["vocab"], draft_vocab_size=vocab,
                         aux_layer_ids=(2, target["layers"] // 2, target["layers"] - 3), mask_token_id=0)
    return drafter_kind(kind).drafter(config, embed_tokens=torch.randn(target["vocab"], target["hidden"]) * 0.02).eval()


def random_features(n: int, shape: str = "smollm2", device: str = "cpu") -> TargetFeatures:
    h = SHAPES[shape]["hidden"]
    return TargetFeatures(torch.randn(n, 3 * h, device=device), torch.randn(n, h, device=device))


def drafting_latency(kind: str, context: int, repeats: int, shape: str = "smollm2", device: str = "cpu",
                     dtype: torch.dtype = torch.float32, cpu_matmul: torch.dtype | None = None) -> dict[int, float]:
    """Median ms per drafting step for K = 1..8. The K values take turns within each repeat, so a burst of load from
    other processes on this shared CPU hits them all alike."""
    drafter = shaped_drafter(kind, shape).to(device=device, dtype=dtype)
    if device == "cpu":
        pack_linears(drafter, cpu_matmul)
    vocab = SHAPES[shape]["vocab"]
    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    def features(n: int) -> TargetFeatures:
        f = random_features(n, shape, device)
        return TargetFeatures(f.aux.to(dtype), f.final.to(dtype))

    states = {}
    for k in range(1, 9):
        states[k] = drafter.begin(features(context), torch.randint(0, vocab, (context,)))
        drafter.propose(states[k], k)  # the prompt's pass is a prefill cost, not a drafting step
    # each step first accepts 2 rows (untimed), then proposes K (timed)
    accept = {k: (lambda s=s: drafter.accept(s, features(2), torch.randint(0, vocab, (2,)))) for k, s in states.items()}
    propose = {k: (lambda k=k, s=s: drafter.propose(s, k)) for k, s in states.items()}
    return median_ms_each(propose, repeats, warmup=2, before=accept, sync=sync)


def catch_up_latency(kind: str, positions: list[int], repeats: int, context: int = 512,
                     cpu_matmul: torch.dtype | None = None) -> dict[int, float]:
    """Median ms of one draft of the drafter's K after `n` positions it has not run yet (a lazy drafter's catch-up:
    the steps a hybrid drafted from its suffix cache), for each n in `positions`; SmolLM2 shapes on this CPU, the
    drafter's state holding `context` real slots before. The router's built-in `DEFAULT_DRAFT_MS` come from here."""
    drafter = shaped_drafter(kind)
    pack_linears(drafter, cpu_matmul)
    vocab, k = SHAPES["smollm2"]["vocab"], drafter.num_speculative_tokens
    states = {}

    def fresh(n: int) -> None:  # untimed: a state that has run `context` slots and holds n more, not yet run
        states[n] = drafter.begin(random_features(context), torch.randint(0, vocab, (context,)))
        drafter.propose(states[n], k)
        drafter.accept(states[n], random_features(n), torch.randint(0, vocab, (n,)))

    before = {n: (lambda n=n: fresh(n)) for n in positions}
    propose = {n: (lambda n=n: drafter.propose(states[n], k)) for n in positions}
    return median_ms_each(propose, repeats, warmup=1, before=before)


def acceptance(kind: str) -> dict[str, dict] | None:
    ckpt = checkpoint_dir(kind)
    if not (ckpt / "config.json").exists():
        return None
    recipe = load_recipe(REPO / "speculators" / "recipes" / f"{RECIPES.get(kind, 'peagle-smollm2')}.yaml")
    root = recipe.feature_dir()  # every *-smollm2 recipe shares it
    store = FeatureStore(root, "heldout")
    embed, _ = load_target_head(root)
    meta = store.meta
    drafter = load_drafter(ckpt, target=TargetInfo(meta["num_layers"], meta["hidden_size"], meta["vocab_size"]),
                           embed_tokens=embed, aux_layer_ids=meta["aux_layer_ids"])
    kinds = {"chat": ("mt_bench", "humaneval"), "agent": ("agent_traces",), "self-instruct": ("self_instruct",)}
    result = {}
    for name, prefixes in kinds.items():
        indices = [i for i, s in enumerate(store.sources) if s.split(":")[0] in prefixes]
        if indices:
            result[name] = evaluate_acceptance(drafter, store, [3, 5, 7], indices, slots_per_batch=256,
                                               tree_width=TREE_WIDTH)
    log = ckpt / "train_log.json"
    if log.exists():
        result["train_seconds"] = json.loads(log.read_text()).get("train_seconds")
    result["checkpoint_mb"] = round(weights_file(ckpt).stat().st_size / 2**20, 2)  # the compact file if shipped so
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--context", type=int, default=512, help="real slots already in the drafter's cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared CPU)")
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2",
                        help="drafter sizes for this target (acceptance is measured for smollm2 only)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--cpu-matmul", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="dtype of the packed matrix products on CPU (auto: as the engine, bfloat16 where native)")
    parser.add_argument("--catch-up", default=None, metavar="N,N,...",
                        help="only time a draft after catching up each number of positions (the router's draft-cost "
                             "tables), e.g. 1,16,64,256,1024")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                        help="also measure this checkpoint (e.g. an ablation), named NAME in the tables")
    parser.add_argument("--kinds", default=",".join(RECIPES), help="the shipped drafters to measure, comma-separated")
    args = parser.parse_args()
    for item in args.extra:
        name, sep, path = item.partition("=")
        if not sep or not (Path(path) / "config.json").is_file():
            parser.error(f"--extra {item!r}: expected NAME=DIR of a drafter checkpoint")
        EXTRA[name] = Path(path)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(RECIPES)
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}; choose from {list(RECIPES)}")
    kinds += list(EXTRA)
    if args.catch_up:
        torch.set_num_threads(args.threads)
        positions = [int(n) for n in args.catch_up.split(",")]
        matmul = torch.bfloat16 if args.cpu_matmul == "bfloat16" or (args.cpu_matmul == "auto" and fast_bf16()) \
            else None
        with torch.inference_mode():
            table = {kind: catch_up_latency(kind, positions, args.repeats, args.context, matmul) for kind in kinds}
        print(f"ms of one draft (the drafter's K) after catching up N positions ({args.threads} thread(s), "
              f"matmuls in {matmul or torch.float32}, median of {args.repeats})")
        print(f"{'N':>6} " + " ".join(f"{kind:>9}" for kind in kinds))
        for n in positions:
            print(f"{n:>6} " + " ".join(f"{table[kind][n]:9.2f}" for kind in kinds))
        write_json(args.json, {"catch_up_ms": table, "threads": args.threads, "context": args.context,
                               "cpu_matmul": str(matmul or torch.float32), "machine": machine_info()})
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    matmul = {"auto": torch.bfloat16 if fast_bf16() else None, "float32": None,
              "bfloat16": torch.bfloat16}[args.cpu_matmul] if args.device == "cpu" else None
    results: dict = {"context": args.context, "threads": args.threads, "shape": args.shape, "device": args.device,
                     "dtype": str(dtype), "cpu_matmul": str(matmul or dtype), "latency_ms": {}, "acceptance": {},
                     "machine": machine_info()}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    with torch.inference_mode():
        for kind in kinds:
            results["latency_ms"][kind] = drafting_latency(kind, args.context, args.repeats, args.shape, args.device,
                                                           dtype, matmul)
    print(f"drafting latency, ms per step ({args.shape} shapes on {args.device}, {dtype}"
          f"{f' (matmuls in {matmul})' if matmul else ''}, context {args.context}, "
          f"{args.threads} thread(s), median of {args.repeats})")
    print(f"{'K':>3} " + " ".join(f"{kind:>9}" for kind in kinds))
    for k in range(1, 9):
        print(f"{k:>3} " + " ".join(f"{results['latency_ms'][kind][k]:9.2f}" for kind in kinds))
    for kind in kinds:
        lat = results["latency_ms"][kind]
        results[f"{kind}_k7_over_k1"] = round(lat[7] / lat[1], 3)
        print(f"{kind}: K=7 costs {lat[7] / lat[1]:.2f}x its K=1")
    if args.shape != "smollm2":
        write_json(args.json, results)
        return
    for kind in kinds:
        results["acceptance"][kind] = acceptance(kind)
    print("\nacceptance length (tokens per step, greedy) on held-out text")
    print(f"{'drafter':>8} {'text':>13} {'K=3':>6} {'K=5':>6} {'K=7':>6} {'steps@7':>8}   "
          f"tree (width {TREE_WIDTH}) K=3 K=5 K=7")
    for kind, res in results["acceptance"].items():
        if res is None:
            print(f"{kind:>8}  (no checkpoint in {checkpoint_dir(kind).relative_to(REPO)})")
            continue
        for text in ("chat", "agent", "self-instruct"):
            if text in res:
                r = res[text]
                print(f"{kind:>8} {text:>13} "
                      f"{r['acceptance@3']:6.2f} {r['acceptance@5']:6.2f} {r['acceptance@7']:6.2f} "
                      f"{r['steps'][7]:8d}   " + " ".join(f"{r[f'tree_acceptance@{k}']:6.2f}" for k in (3, 5, 7)))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
