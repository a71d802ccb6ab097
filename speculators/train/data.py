"""Training features: the target's features over the training text (`text.py`), cached on disk in shards.

A cache directory holds `meta.json` (the target's facts and the aux layer ids), `target_head.safetensors` (the
target's input embedding and lm_head, which the drafters share or distil from), and shards
`{train,heldout}-NNNNN.safetensors`, each written atomically: a shard that exists is complete, so an interrupted
build resumes at the first missing one. A shard holds, for its sequences concatenated:
    tokens [S] int32, offsets [n+1] int64, response_start [n] int64 (index of the first trained-on token),
    aux [S, kH] fp16 (target hidden states at the inputs of the aux layers), final [S, H] fp16 (final hidden state),
    topk_ids [S, k] int32 / topk_logits [S, k] fp16 (the target's next-token logits at each position),
and in its metadata "sources": the data source of each sequence (JSON list).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm.auto import tqdm

from hybridspec.speculators.features import default_aux_layer_ids
from hybridspec.speculators.train.recipe import Recipe
from hybridspec.speculators.train.text import (SPLITS, Item, NotGeneratedError, ResponseCache, generate_responses,
                                               load_items, target_fingerprint, write_self_instruct)


# ---------------------------------------------------------------------------------------------------------------------
# building the cache


def _prompt_ids(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """Chat-templated prompt ids with the user text cut to max_tokens tokens (its head kept)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    messages = [{"role": "user", "content": tokenizer.decode(ids)}]
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return ids


def _response_ids(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    if len(ids) < max_tokens and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def target_features(model: Any, tokens: list[int], aux_layer_ids: Sequence[int], top_k: int) -> dict[str, Tensor]:
    """The target's aux hidden states, final hidden state and top-k next-token logits at every position."""
    return target_features_many(model, [tokens], aux_layer_ids, top_k)[0]


@torch.inference_mode()
def target_features_many(model: Any, sequences: list[list[int]], aux_layer_ids: Sequence[int], top_k: int,
                         max_batch_tokens: int = 16384) -> list[dict[str, Tensor]]:
    """`target_features` of several sequences, on the CPU. On the CPU one sequence per pass; on an accelerator
    several per pass, padded on the right to the longest (causal attention: no position sees the padding after it),
    up to max_batch_tokens padded tokens."""
    device = model.get_output_embeddings().weight.device
    per_pass = 1 if device.type == "cpu" else max(1, max_batch_tokens // max(len(s) for s in sequences))
    out = []
    for start in range(0, len(sequences), per_pass):
        group = sequences[start: start + per_pass]
        width = max(len(s) for s in group)
        ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in group], device=device)
        hidden = model.base_model(input_ids=ids, output_hidden_states=True).hidden_states
        logits = model.get_output_embeddings()(hidden[-1])
        values, indices = torch.topk(logits.float(), top_k, dim=-1)
        aux = torch.cat([hidden[i] for i in aux_layer_ids], dim=-1).half()
        for row, s in enumerate(group):
            n = len(s)
            out.append({"aux": aux[row, :n].cpu(), "final": hidden[-1][row, :n].half().cpu(),
                        "topk_ids": indices[row, :n].int().cpu(), "topk_logits": values[row, :n].half().cpu()})
    return out


def _save_atomic(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def target_meta(model: Any, tokenizer: Any, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {"num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "aux_layer_ids": list(aux_layer_ids), "pad_token_id": tokenizer.pad_token_id,
            "name_or_path": getattr(cfg, "_name_or_path", ""), "architectures": list(cfg.architectures or []),
            "config": cfg.to_dict()}


def response_cache(recipe: Recipe, fingerprint: str) -> ResponseCache:
    """The target's greedy responses already generated for this recipe's data settings (by prompt ids)."""
    return ResponseCache(recipe.generated_dir() / f"responses-{fingerprint}-{recipe.data.max_new_tokens}.jsonl")


def build_features(recipe: Recipe, model: Any, tokenizer: Any, progress: bool = True, *, engine: Any = None,
                   deadline: float | None = None, items: dict[str, list[Item]] | None = None) -> Path:
    """Compute (or finish computing) the recipe's feature cache; returns its directory.

    engine: what writes the target's responses when a source is in generate mode: `generate(prompts, **options)`
    returning results with `token_ids`, and `tokenizer` (the runtime's `Engine` over `model`, which the caller wires:
    the training library does not import the runtime). deadline (time.monotonic()): stop cleanly, between batches of
    self-instruct requests and between shards, once it has passed and each split has a shard; the next call resumes.
    items: the sequences of each split instead of `load_items(recipe)` (the same lists, in the same order, on every call
    that resumes the cache: a shard is found by its index).
    """
    root = recipe.feature_dir()
    root.mkdir(parents=True, exist_ok=True)
    num_layers = model.config.num_hidden_layers
    aux_ids = tuple(recipe.architecture.aux_layer_ids or default_aux_layer_ids(num_layers))
    meta = target_meta(model, tokenizer, aux_ids)
    meta_file = root / "meta.json"
    if meta_file.exists():
        old = json.loads(meta_file.read_text())
        if (old["hidden_size"], old["vocab_size"], old["aux_layer_ids"]) != (meta["hidden_size"], meta["vocab_size"],
                                                                              meta["aux_layer_ids"]):
            raise ValueError(f"{root} holds features of another target or other layers; remove it or set "
                             "data.cache_dir")
    else:
        meta_file.write_text(json.dumps(meta, indent=1))
    head_file = root / "target_head.safetensors"
    if not head_file.exists():
        embed = model.get_input_embeddings().weight.detach().float().cpu()
        head = model.get_output_embeddings().weight.detach().float().cpu()
        tensors = {"embed_tokens": embed} if head.data_ptr() == embed.data_ptr() else {"embed_tokens": embed,
                                                                                      "lm_head": head}
        _save_atomic(tensors, head_file)

    spec = recipe.data
    responses_cache = None  # only generate-mode items (response None) look into it
    if any(s.mode == "generate" for s in spec.sources) or any(
            i.response is None for split in (items or {}).values() for i in split):
        if engine is None:
            raise ValueError("the recipe has generate-mode sources: pass engine= (e.g. hybridspec's Engine over the "
                             "target) to write the target's responses")
        fingerprint = target_fingerprint(model)
        responses_cache = response_cache(recipe, fingerprint)
        for source in spec.sources:
            if source.kind == "self_instruct":
                write_self_instruct(recipe, source, engine, fingerprint, progress, deadline)
    items = load_items(recipe) if items is None else items
    for split in SPLITS:
        chunks = [items[split][i: i + spec.shard_size] for i in range(0, len(items[split]), spec.shard_size)]
        todo = [(i, c) for i, c in enumerate(chunks) if not (root / f"{split}-{i:05d}.safetensors").exists()]
        bar = tqdm(total=sum(len(c) for _, c in todo), desc=f"features ({split})", unit="seq", disable=not progress)
        for index, chunk in todo:
            if deadline is not None and time.monotonic() >= deadline and any(root.glob(f"{split}-*.safetensors")):
                break
            prompts = [_prompt_ids(tokenizer, item.prompt, spec.max_prompt_tokens) for item in chunk]
            responses: list[list[int] | None] = [
                _response_ids(tokenizer, item.response, spec.max_text_tokens) if item.response is not None else None
                for item in chunk]
            for j, r in enumerate(responses):
                if r is None:
                    responses[j] = responses_cache.get(prompts[j])
            to_generate = [j for j, r in enumerate(responses) if r is None]
            for start in range(0, len(to_generate), spec.generation_batch_size):
                batch = to_generate[start: start + spec.generation_batch_size]
                generated = generate_responses(engine, [prompts[j] for j in batch], spec.max_new_tokens)
                responses_cache.add([prompts[j] for j in batch], generated)
                for j, r in zip(batch, generated):
                    responses[j] = r
            parts, starts, sources = [], [], []
            kept = [(item, prompt, response) for item, prompt, response in zip(chunk, prompts, responses)
                    if len(response) >= 2]  # shorter: nothing a drafter could learn from
            features = target_features_many(model, [p + r for _, p, r in kept], aux_ids, spec.top_k) if kept else []
            bar.update(len(chunk))
            for (item, prompt, response), feats in zip(kept, features):
                parts.append(feats)
                parts[-1]["tokens"] = torch.tensor(prompt + response, dtype=torch.int32)
                starts.append(len(prompt))
                sources.append(item.source)
            if parts:
                lengths = torch.tensor([p["tokens"].numel() for p in parts])
                shard = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
                shard["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
                shard["response_start"] = torch.tensor(starts, dtype=torch.long)
            else:
                shard = {"offsets": torch.zeros(1, dtype=torch.long)}
            _save_atomic(shard, root / f"{split}-{index:05d}.safetensors", {"sources": json.dumps(sources)})
        bar.close()
    return root


# ---------------------------------------------------------------------------------------------------------------------
# reading the cache


class FeatureStore:
    """All sequences of one split of a feature cache, in memory (fp16 features)."""

    def __init__(self, root: str | os.PathLike, split: str) -> None:
        root = Path(root)
        if not (root / "meta.json").exists():
            raise FileNotFoundError(f"{root} is not a feature cache (no meta.json): run the data step first")
        self.meta = json.loads((root / "meta.json").read_text())
        shards, self.sources = [], []  # sources: the data source of each sequence
        for path in sorted(root.glob(f"{split}-*.safetensors")):
            shard = load_file(str(path))
            if shard["offsets"].numel() > 1:
                shards.append(shard)
                with safe_open(str(path), "pt") as f:
                    self.sources.extend(json.loads(f.metadata()["sources"]))
        if not shards:
            raise ValueError(f"{root} has no {split} sequences")
        keys = ("tokens", "aux", "final", "topk_ids", "topk_logits")
        self.data = {k: torch.cat([s[k] for s in shards]) for k in keys}
        spans, base = [], 0
        for s in shards:
            offsets = s["offsets"]
            for i in range(offsets.numel() - 1):
                spans.append((base + int(offsets[i]), base + int(offsets[i + 1]), int(s["response_start"][i])))
            base += int(offsets[-1])
        self.spans = spans  # (start, end, response start relative to start) per sequence

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def num_tokens(self) -> int:
        return self.data["tokens"].numel()

    def response_target_counts(self, vocab_size: int, indices: Sequence[int] | None = None) -> Tensor:
        """How often each token is the target's greedy next token inside the responses of the sequences `indices`
        (default: all), the draft vocabulary's input."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        top1 = self.data["topk_ids"][:, 0].long()
        for start, end, rs in (self.spans if indices is None else [self.spans[i] for i in indices]):
            counts += torch.bincount(top1[start + rs - 1: end - 1], minlength=vocab_size)
        return counts


def load_target_head(root: str | os.PathLike) -> tuple[Tensor, Tensor]:
    """(input embedding, lm_head weight) of the target the cache was built with."""
    head = load_file(str(Path(root) / "target_head.safetensors"))
    return head["embed_tokens"], head.get("lm_head", head["embed_tokens"])


def features_complete(recipe: Recipe) -> bool:
    """True when the cache already holds every shard the recipe's data would produce (no target needed then)."""
    root = recipe.feature_dir()
    if not ((root / "meta.json").exists() and (root / "target_head.safetensors").exists()):
        return False
    try:
        items = load_items(recipe)
    except NotGeneratedError:
        return False
    size = recipe.data.shard_size
    return all((root / f"{split}-{i:05d}.safetensors").exists()
               for split in SPLITS for i in range(math.ceil(len(items[split]) / size)))
