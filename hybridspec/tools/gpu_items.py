"""The shipped recipes' prompts for a GPU machine without ../shared: `pack_items` here, `read_items` / `combine` there.

The *-smollm2 recipes share one data section whose sources (agent traces, MT-Bench, HumanEval under ../shared, and
the target's own self-instruct requests) are not on the GPU machine. `pack_items` writes their items, both splits, as
`text.load_items` splits them (by content hash, a training item whose prompt is held out left out), text only, into a
JSONL that travels inside the weights' payload (`gpu_weights.pack`) and lands beside the staged target
(`.gpu/store/target/recipe_items.jsonl`). There `gpu_run` has the target answer them first and fills the rest of its
data share with self-instruct text (`combine`): the held-out split is the recipes' own held-out items, and nothing
held out by the recipes' split is trained on.

The self-instruct requests of the recipes are included only where this machine has them (written by `hybridspec train
RECIPE --data-only`); otherwise the file says so and the GPU's own requests fill in, split by the same content hash
at the recipes' held-out fraction (a request that is held out here is held out there too).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ITEMS_FILE = "recipe_items.jsonl"
RECIPE = "peagle-smollm2.yaml"  # every *-smollm2 recipe has this data section (pack_items checks it)
FORMAT = 1


def shipped_recipes(root: Path) -> list[Path]:
    return sorted((root / "speculators" / "recipes").glob("*-smollm2.yaml"))


def pack_items(root: Path) -> tuple[bytes, dict[str, Any]]:
    """(the JSONL, its header) of the shipped recipes' items, both splits. The first line is the header (the recipe,
    its held-out fraction and sources, counts per split and source); then one item a line: split, source, prompt,
    response (null: the target answers it), key (`Item.key`, its content hash)."""
    import dataclasses

    from hybridspec.speculators.train import load_recipe
    from hybridspec.speculators.train.text import self_instruct_file
    from hybridspec.speculators.train.text import load_items as load

    recipes = {p.name: load_recipe(p) for p in shipped_recipes(root)}
    recipe = recipes[RECIPE]
    data = {name: r.data_key() for name, r in recipes.items()}
    if len(set(data.values())) != 1:
        raise ValueError(f"the *-smollm2 recipes' data sections differ ({data}): pack_items assumes they share one")
    generated = [s for s in recipe.data.sources if s.kind == "self_instruct" and self_instruct_file(recipe, s).exists()]
    wanted = [s for s in recipe.data.sources if s.kind == "self_instruct"]
    items = load(recipe, skip_ungenerated=True)
    counts: dict[str, dict[str, int]] = {}
    for split, rows in items.items():
        for item in rows:
            name = item.source + (" (text)" if item.response is not None else "")
            counts.setdefault(split, {}).setdefault(name, 0)
            counts[split][name] += 1
    header = {"format": FORMAT, "recipes": sorted(recipes), "recipe": RECIPE, "data_key": recipe.data_key(),
              "heldout_fraction": recipe.data.heldout_fraction, "max_new_tokens": recipe.data.max_new_tokens,
              "max_prompt_tokens": recipe.data.max_prompt_tokens,
              "sources": [dataclasses.asdict(s) for s in recipe.data.sources],
              "self_instruct": ("included" if len(generated) == len(wanted) else
                                "not written on the packing machine: the GPU writes its own requests (same hash "
                                "split)"),
              "counts": counts}
    return items_jsonl(header, items), header


def items_jsonl(header: dict[str, Any], items: dict[str, list[Any]]) -> bytes:
    """The file: the header (with this format's number) and one item a line, held-out items first."""
    lines = [json.dumps({**header, "format": FORMAT})] + [
        json.dumps({"split": split, "source": i.source, "prompt": i.prompt, "response": i.response, "key": i.key})
        for split in ("heldout", "train") for i in items[split]]
    return ("\n".join(lines) + "\n").encode()


def read_items(path: Path) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(header, {"heldout": [Item], "train": [Item]}) of a file `pack_items` wrote; every item's key is checked."""
    from hybridspec.speculators.train.text import Item

    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("format") != FORMAT:
        raise ValueError(f"{path} is not a recipe-items file of format {FORMAT}")
    out: dict[str, list[Item]] = {"heldout": [], "train": []}
    for row in lines[1:]:
        item = Item(row["source"], row["prompt"], row["response"])
        if item.key != row["key"]:
            raise ValueError(f"{path}: an item's key does not match its text ({row['key']})")
        out[row["split"]].append(item)
    return lines[0], out


def combine(recipe_items: dict[str, list[Any]], filler: dict[str, list[Any]],
            fraction: float) -> tuple[dict[str, list[Any]], dict[str, int]]:
    """The splits the GPU builds: held out, the recipes' held-out items only; trained on, the recipes' training items
    first, then the filler's (self-instruct, or --prompts) items that are not held out by the content hash at the
    recipes' fraction, not a recipe item, and whose prompt is no held-out item's prompt. Returns them and counts."""
    from hybridspec.speculators.train.text import heldout

    held = list(recipe_items["heldout"])
    held_prompts = {i.prompt for i in held}
    seen = {i.key for split in recipe_items.values() for i in split}
    counts = {"recipe_heldout": len(held), "recipe_train": len(recipe_items["train"]),
              "filler_heldout_dropped": len(filler.get("heldout", [])), "filler_train": 0,
              "filler_train_dropped": 0}
    extra = []
    for item in filler.get("train", []):
        if item.key in seen or item.prompt in held_prompts or heldout(item, fraction):
            counts["filler_train_dropped"] += 1
        else:
            seen.add(item.key)
            extra.append(item)
    counts["filler_train"] = len(extra)
    return {"heldout": held, "train": list(recipe_items["train"]) + extra}, counts
