"""Issue 35: held-out acceptance of the shipped heads before (bfloat16 model.safetensors, read from a git revision) and
after (the compact 8-bit model.safetensors.q8 in the working tree), on one held-out sample, greedy, offline
(hybridspec.speculators.train.evaluation.evaluate_acceptance, as bench_drafters measures them).

    python benchmarks/bench_compact_heads.py [--before-rev 59a6b64] [--json PATH]

The sample: the target's greedy responses to held-out prompts of the *-smollm2 recipes' generate sources that need
no self-instruct step (MT-Bench, HumanEval, agent-trace user turns), built once (minutes on 2 cores) into its own
feature cache. Every prompt in it is held out by the recipes' content-hash split (`text.heldout`): the recipe's own
held-out items of these sources, plus further hash-held-out HumanEval prompts and agent turns up to --agent-items
(agent turns whose prompt is also a train-only logged turn are left out), never trained on. The recipes' self-instruct
held-out text is not in it (building it means having the target write 1,200 requests first, ~40 min here).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import torch

from common import REPO, machine_info, write_json
from hybridspec.speculators import TargetInfo, load_drafter
from hybridspec.speculators.train import FeatureStore, load_recipe
from hybridspec.speculators.train import data as train_data
from hybridspec.speculators.train.evaluation import evaluate_acceptance
from hybridspec.speculators.train.recipe import cache_root
from hybridspec.speculators.train.text import _source_items, heldout, load_items

HEADS = ("fasteagle", "peagle", "eagle3", "lstm")
KS = [3, 5, 7]
TREE_WIDTH = 3  # the engine's default trees (bench_drafters.TREE_WIDTH)
TEXTS = {"chat": ("mt_bench", "humaneval"), "agent": ("agent_traces",)}


def sample_items(recipe, agent_items: int) -> list:
    """The held-out sample: the recipe's held-out items of its generate sources other than self_instruct, then more
    hash-held-out HumanEval prompts and agent turns (never trained on)."""
    generate = [s for s in recipe.data.sources if s.mode == "generate" and s.kind != "self_instruct"]
    train_only_prompts = {i.prompt for s in recipe.data.sources if s.train_only and s.kind != "self_instruct"
                          for i in _source_items(s, recipe.path(s.path))}
    own = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, sources=generate))
    items = load_items(own)["heldout"]
    seen = {i.key for i in items}
    frac = recipe.data.heldout_fraction
    for source in generate:
        if source.max_items is None:
            continue
        cap = agent_items if source.kind == "agent_traces" else None
        extra = sorted((i for i in _source_items(source, recipe.path(source.path))
                        if i.prompt.strip() and heldout(i, frac) and i.key not in seen
                        and i.prompt not in train_only_prompts), key=lambda i: i.key)
        have = sum(i.source.startswith(source.kind) for i in items)
        items += extra if cap is None else extra[: max(0, cap - have)]
        seen |= {i.key for i in extra}
    return items


def build_sample(recipe, agent_items: int) -> Path:
    items = sample_items(recipe, agent_items)
    key = f"heldout-sample-{recipe.data_key()}-{len(items)}"
    root = cache_root() / "features" / key
    generate = [s for s in recipe.data.sources if s.mode == "generate" and s.kind != "self_instruct"]
    sample = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, cache_dir=str(root), sources=generate))
    if len(list(root.glob("heldout-*.safetensors"))) == -(-len(items) // recipe.data.shard_size):
        return root  # every shard is there (each is written atomically)
    from hybridspec.model.loading import load_model, load_tokenizer
    from hybridspec.model.target import TargetModel
    from hybridspec.runtime.engine import Engine

    model, tokenizer = load_model(recipe.target), load_tokenizer(recipe.target)
    engine = Engine(TargetModel(model), tokenizer)
    # the sample's items as the held-out split, no training split
    with mock.patch.object(train_data, "load_items", lambda _recipe: {"heldout": items, "train": []}):
        train_data.build_features(sample, model, tokenizer, engine=engine)
    return root


def measure(ckpt: Path, store: FeatureStore, embed: torch.Tensor) -> dict:
    meta = store.meta
    drafter = load_drafter(ckpt, target=TargetInfo(meta["num_layers"], meta["hidden_size"], meta["vocab_size"]),
                           embed_tokens=embed, aux_layer_ids=meta["aux_layer_ids"])
    out = {}
    for name, prefixes in TEXTS.items():
        indices = [i for i, s in enumerate(store.sources) if s.split(":")[0] in prefixes]
        r = evaluate_acceptance(drafter, store, KS, indices, slots_per_batch=256, tree_width=TREE_WIDTH)
        out[name] = {k: r[k] for k in r if k.startswith(("acceptance@", "tree_acceptance@"))}
        out[name]["steps@7"] = r["steps"][7]
        out[name]["sequences"] = len(indices)
    return out


def before_checkpoint(kind: str, rev: str, into: Path) -> Path:
    """The head as it was at `rev` (config.json and the bfloat16 model.safetensors), copied out of git."""
    rel = f"speculators/checkpoints/{kind}-smollm2"
    out = into / kind
    out.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        blob = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel}/{name}"], check=True,
                              capture_output=True).stdout
        (out / name).write_bytes(blob)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before-rev", default="59a6b64", help="git revision holding the bfloat16 heads")
    parser.add_argument("--agent-items", type=int, default=24, help="agent turns in the sample")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", default=",".join(HEADS))
    parser.add_argument("--build-only", action="store_true", help="build the sample's feature cache and stop")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(REPO / "speculators" / "recipes" / "peagle-smollm2.yaml")  # all *-smollm2 share the data
    root = build_sample(recipe, args.agent_items)
    if args.build_only:
        print(f"sample ready in {root}")
        return
    store = FeatureStore(root, "heldout")
    embed, _ = train_data.load_target_head(root)
    results: dict = {"before_rev": args.before_rev, "sample": str(root), "machine": machine_info(), "heads": {}}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for kind in args.heads.split(","):
            after_dir = REPO / "speculators" / "checkpoints" / f"{kind}-smollm2"
            results["heads"][kind] = {"before": measure(before_checkpoint(kind, args.before_rev, Path(tmp)), store,
                                                        embed),
                                      "after": measure(after_dir, store, embed)}
    print(f"held-out sample: {len(store)} sequences, {store.num_tokens} tokens ({root.name})")
    print(f"{'head':>9} {'text':>6} {'K=3':>13} {'K=5':>13} {'K=7':>13} {'tree K=7':>13}   (before -> after)")
    for kind, r in results["heads"].items():
        for text in TEXTS:
            b, a = r["before"][text], r["after"][text]
            cells = [f"{b[f'acceptance@{k}']:.3f}->{a[f'acceptance@{k}']:.3f}" for k in KS]
            cells.append(f"{b['tree_acceptance@7']:.3f}->{a['tree_acceptance@7']:.3f}")
            print(f"{kind:>9} {text:>6} " + " ".join(f"{c:>13}" for c in cells))
    write_json(args.json, results)
    print(json.dumps({k: {t: round(v['after'][t]['acceptance@7'] - v['before'][t]['acceptance@7'], 4)
                          for t in TEXTS} for k, v in results["heads"].items()}))


if __name__ == "__main__":
    main()
