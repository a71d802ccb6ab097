"""The data phase of `hybridspec gpu-run` (`gpu_run.build_data`): the target's text and the feature cache on the GPU.

With the shipped recipes' items (`gpu_items`, staged with the target) the target answers them first, both splits
(`pregenerate`, into the response cache `speculators.train.data.build_features` reads), then writes its self-instruct
requests in their part of the share and answers them until the share ends; `build_features` then computes the
features, the recipes' items first. Held out are the recipes' held-out items only (`gpu_items.combine`).
"""
from __future__ import annotations

import json
import time
from typing import Any

from hybridspec.tools.gpu_items import combine


def pregenerate(recipe: Any, items: dict[str, list[Any]], tokenizer: Any, generator: Any,
                fingerprint: str) -> dict[str, Any]:
    """The target's greedy responses to the items (both splits) that have none yet, into the response cache that
    `build_features` reads: the recipes' prompts are answered before any self-instruct text is written."""
    from hybridspec.speculators.train.data import _prompt_ids, response_cache
    from hybridspec.speculators.train.text import generate_responses

    spec, cache = recipe.data, response_cache(recipe, fingerprint)
    todo: dict[str, list[int]] = {}
    for split in ("heldout", "train"):
        for item in items[split]:
            if item.response is None:
                ids = _prompt_ids(tokenizer, item.prompt, spec.max_prompt_tokens)
                if cache.get(ids) is None:
                    todo[cache.key(ids)] = ids
    prompts, start, tokens = list(todo.values()), time.monotonic(), generator.generated_tokens
    for b in range(0, len(prompts), spec.generation_batch_size):
        batch = prompts[b: b + spec.generation_batch_size]
        cache.add(batch, generate_responses(generator, batch, spec.max_new_tokens))
    return {"responses": len(prompts), "tokens": generator.generated_tokens - tokens,
            "seconds": round(time.monotonic() - start, 1)}


def build_data(run: Any, recipe: Any, target: str, device: Any, scale: dict[str, Any], deadline: float,
               recipe_items: dict[str, list[Any]] | None = None) -> dict:
    """The feature cache. With the recipes' items: the target answers them first (both splits), then writes its
    self-instruct requests (their share of the data share) and answers those until the deadline; held out are the
    recipes' held-out items only (`gpu_items.combine`). Without: the filler's own hash split, as a recipe has it,
    its held-out part cut to the sequences evaluated."""
    import dataclasses

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridspec.speculators.train import data as data_module
    from hybridspec.speculators.train.text import NotGeneratedError, load_items, target_fingerprint, write_self_instruct
    from hybridspec.tools.gpu_generate import BatchGenerator

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device).eval()
    gen_model = model if device.type == "cpu" else AutoModelForCausalLM.from_pretrained(
        target, dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()
    generator = BatchGenerator(gen_model, tokenizer, max_batch=recipe.data.generation_batch_size)
    fingerprint = target_fingerprint(model)
    counts: dict[str, Any] = {}
    if recipe_items is not None:
        counts["recipe_responses"] = pregenerate(recipe, recipe_items, tokenizer, generator, fingerprint)
        run.log(f"data: the recipes' items answered: {counts['recipe_responses']}")
    requests = [s for s in recipe.data.sources if s.kind == "self_instruct"]
    if requests:  # the target's own requests, in their part of the share (then its answers and features)
        until = time.monotonic() + scale["requests_share"] * max(0.0, deadline - time.monotonic())
        for source in requests:
            try:
                write_self_instruct(recipe, source, generator, fingerprint, False, until)
            except Exception as e:  # with the recipes' items there is still data: go on without this source
                if recipe_items is None:
                    raise
                run.log(f"data: self-instruct requests failed ({type(e).__name__}: {e}); the recipes' items only")
                recipe = dataclasses.replace(recipe, data=dataclasses.replace(
                    recipe.data, sources=[s for s in recipe.data.sources if s is not source]))
    items = None
    if recipe_items is not None:
        try:
            filler = load_items(recipe)
        except (NotGeneratedError, FileNotFoundError) as e:
            run.log(f"data: no filler text ({e})")
            filler = {}
        fraction = max(recipe.data.heldout_fraction, run.figures.get("recipe_items", {}).get("heldout_fraction", 0))
        items, counts["items"] = combine(recipe_items, filler, fraction)
        run.log(f"data: items {counts['items']}")
    else:  # held out: as many as are evaluated (the rest of what the hash holds out is dropped, never trained on)
        items = load_items(recipe)
        items["heldout"] = items["heldout"][: recipe.training.eval_max_sequences]
    many = data_module.target_features_many
    data_module.target_features_many = lambda m, seqs, aux, k: many(m, seqs, aux, k, scale["feature_tokens"])
    try:
        root = data_module.build_features(recipe, model, tokenizer, progress=False, engine=generator,
                                          deadline=deadline, items=items)
    finally:
        data_module.target_features_many = many
    for split in ("train", "heldout"):
        seqs = tokens = 0
        by_source: dict[str, int] = {}
        for shard in sorted(root.glob(f"{split}-*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                offsets = f.get_tensor("offsets")
                for source in json.loads(f.metadata()["sources"]):
                    by_source[source.split(":")[0]] = by_source.get(source.split(":")[0], 0) + 1
            seqs, tokens = seqs + offsets.numel() - 1, tokens + int(offsets[-1])
        counts[split] = {"sequences": seqs, "tokens": tokens, "by_source": by_source}
    counts["generated_tokens"] = generator.generated_tokens
    counts["generation_seconds"] = round(generator.seconds, 1)
    counts["generated_tokens_per_s"] = round(generator.generated_tokens / max(generator.seconds, 1e-9), 1)
    counts["feature_dir"] = str(root)
    run.log(f"data: {json.dumps(counts)}")
    del model, gen_model
    return counts
