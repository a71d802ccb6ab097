"""Training data: prompts and texts, the target's responses, and the target features cached on disk in shards.

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

import gzip
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm.auto import tqdm

from hybridspec.speculators.features import default_aux_layer_ids
from hybridspec.speculators.train.recipe import PromptSource, Recipe

SPLITS = ("heldout", "train")  # held-out first: a partial cache can already be evaluated on
SELF_INSTRUCT_TOKENS = 96  # a self-instruct request still unfinished after this many tokens is dropped


@dataclass(frozen=True)
class Item:
    """One training sequence to build: a user prompt, and (mode "text") the response text to use instead of the
    target's own answer."""

    source: str
    prompt: str
    response: str | None = None

    @property
    def key(self) -> str:
        return hashlib.sha1(f"{self.source}\0{self.prompt}\0{self.response}".encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# sources


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part messages: keep the text parts
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _conversations(path: Path) -> Iterator[list[dict]]:
    """Message lists of the agent trace files under path (SWE-agent .traj, mini-swe-agent .traj.json,
    AutoCodeRover conversation_round_*.json)."""
    patterns = ("*.traj", "*.traj.json", "conversation_round_*.json")
    files = [f for pattern in patterns for f in sorted(path.rglob(pattern))]
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        messages = data if isinstance(data, list) else data.get("history") or data.get("messages") or []
        yield [m for m in messages if isinstance(m, dict) and "role" in m]


def self_instruct_file(recipe: Recipe, source: PromptSource) -> Path:
    key = hashlib.sha1(json.dumps([recipe.target, source.max_items, source.seed]).encode()).hexdigest()[:12]
    return recipe.generated_dir() / f"self_instruct-{key}.jsonl"


class NotGeneratedError(FileNotFoundError):
    """A source's prompts are written by the target and have not been written yet."""


def _source_items(source: PromptSource, path: Path) -> list[Item]:
    name = f"{source.kind}:{path.name}"
    if source.kind == "self_instruct":
        rows = [json.loads(line) for line in path.read_text().splitlines()[1:] if line.strip()]
        return [Item(f"self_instruct:{source.seed}", r["prompt"]) for r in rows]
    if source.kind == "agent_traces":
        items = []
        for messages in _conversations(path):
            for i, m in enumerate(messages):
                if source.mode == "generate" and m["role"] == "user":
                    items.append(Item(name, _message_text(m.get("content"))))
                elif source.mode == "text" and m["role"] == "assistant" and i > 0 and messages[i - 1]["role"] == "user":
                    items.append(Item(name, _message_text(messages[i - 1].get("content")),
                                      _message_text(m.get("content"))))
        return items
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if source.kind == "mt_bench":
        if source.mode == "text":
            raise ValueError("mt_bench has no responses: use mode 'generate'")
        return [Item(name, r["turns"][0]) for r in rows]
    if source.kind == "humaneval":
        prompt = "Complete this Python function.\n\n```python\n{}```"
        return [Item(name, prompt.format(r["prompt"]), r["canonical_solution"] if source.mode == "text" else None)
                for r in rows]
    if source.mode == "generate":
        return [Item(name, r["text"]) for r in rows]
    return [Item(name, r["prompt"], r["text"]) for r in rows]


def heldout(item: Item, fraction: float) -> bool:
    """Stable split by content hash: the same text is always on the same side."""
    return int(item.key[:8], 16) / 0x100000000 < fraction


def load_items(recipe: Recipe, skip_ungenerated: bool = False) -> dict[str, list[Item]]:
    """Deduplicated items per split, in a stable order (by content hash), each source capped at max_items.

    A training item whose prompt is a held-out item's prompt (of any source) is left out: another answer to a held-out
    question would leak it into training. skip_ungenerated: leave out self_instruct sources whose requests are not
    written yet (the other sources' splits do not depend on them) instead of raising NotGeneratedError.
    """
    frac = recipe.data.heldout_fraction
    per_source = []
    for source in recipe.data.sources:
        if source.kind == "self_instruct":
            path = self_instruct_file(recipe, source)
            if not path.exists():
                if skip_ungenerated:
                    continue
                raise NotGeneratedError(f"the target has not written this recipe's self_instruct requests yet "
                                        f"({path}): run `hybridspec train RECIPE --data-only`")
        else:
            path = recipe.path(source.path)
        if not path.exists():
            raise FileNotFoundError(f"data source {source.kind} not found at {path}")
        unique = {i.key: i for i in _source_items(source, path)
                  if i.prompt.strip() and (i.response is None or i.response.strip())}
        items = [unique[k] for k in sorted(unique)]
        if source.train_only:
            per_source.append(([], items, source.max_items))
            continue
        held = [i for i in items if heldout(i, frac)]
        train = [i for i in items if not heldout(i, frac)]
        if source.max_items is None:
            per_source.append((held, train, None))
        else:
            n_held = max(1, round(source.max_items * frac))
            per_source.append((held[:n_held], train, source.max_items - n_held))
    heldout_prompts = {i.prompt for held, _, _ in per_source for i in held}
    out: dict[str, list[Item]] = {s: [] for s in SPLITS}
    for held, train, max_train in per_source:
        out["heldout"].extend(held)
        out["train"].extend([i for i in train if i.prompt not in heldout_prompts][:max_train])
    return out


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


def generate_responses(engine: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy responses of the target (ending with its EOS token when it stopped on one), one batch on the engine."""
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=max_new_tokens, speculate="none")]


def target_fingerprint(model: Any) -> str:
    """Identifies a target's weights (its config, embedding and lm_head) for the caches of text it generated."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h = hashlib.sha1(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        h.update(weight.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def request_header(tokenizer: Any) -> list[int]:
    """The chat template up to where a user's request starts: the target continues it with a request of its own."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self_instruct needs a tokenizer with a chat template")
    marker = "{request}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def write_self_instruct(recipe: Recipe, source: PromptSource, engine: Any, fingerprint: str,
                        progress: bool = True) -> Path:
    """Have the target write `source.max_items` distinct user requests (sampled at temperature 1, top-p 0.95, from
    its chat template's user-turn header; kept only when it ended the turn itself). Resumable per batch."""
    path = self_instruct_file(recipe, source)
    if path.exists() and json.loads(path.read_text().split("\n", 1)[0]).get("fingerprint") == fingerprint:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    batches: dict[int, list[str]] = {}
    if partial.exists():
        lines = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
        if lines and lines[0].get("fingerprint") == fingerprint:
            batches = {row["batch"]: row["requests"] for row in lines[1:]}
    if not batches:
        partial.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
    wanted, size = source.max_items, recipe.data.generation_batch_size
    requests = list(dict.fromkeys(r for b in sorted(batches) for r in batches[b]))
    header = request_header(engine.tokenizer)
    bar = tqdm(total=wanted, initial=min(len(requests), wanted), desc="self-instruct requests", unit="req",
               disable=not progress)
    batch = max(batches, default=-1) + 1
    while len(requests) < wanted:
        if batch >= 4 * math.ceil(wanted / size) + 4:
            raise RuntimeError(f"the target wrote only {len(requests)} distinct finished requests of {wanted} in "
                               f"{batch} batches; lower max_items")
        results = engine.generate([header] * size, max_new_tokens=SELF_INSTRUCT_TOKENS, temperature=1.0, top_p=0.95,
                                  speculate="none", seed=source.seed * 1_000_003 + batch)
        new = [r.text.strip() for r in results if r.finish_reason == "eos" and len(r.text.strip()) >= 16]
        with partial.open("a") as f:
            f.write(json.dumps({"batch": batch, "requests": new}) + "\n")
        before = len(requests)
        requests = list(dict.fromkeys(requests + new))
        bar.update(min(len(requests), wanted) - min(before, wanted))
        batch += 1
    bar.close()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in
                           [{"fingerprint": fingerprint}] + [{"prompt": r} for r in requests[:wanted]]))
    os.replace(tmp, path)
    partial.unlink()
    return path


class ResponseCache:
    """The target's greedy responses by prompt, on disk (JSONL, appended per batch): adding a data source or
    rebuilding the features does not generate again what was generated once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.responses: dict[str, list[int]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interruption
                    continue
                self.responses[row["prompt"]] = row["response"]

    @staticmethod
    def key(prompt: list[int]) -> str:
        return hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:20]

    def get(self, prompt: list[int]) -> list[int] | None:
        return self.responses.get(self.key(prompt))

    def add(self, prompts: list[list[int]], responses: list[list[int]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for prompt, response in zip(prompts, responses):
                self.responses[self.key(prompt)] = response
                f.write(json.dumps({"prompt": self.key(prompt), "response": response}) + "\n")


@torch.inference_mode()
def target_features(model: Any, tokens: list[int], aux_layer_ids: Sequence[int], top_k: int) -> dict[str, Tensor]:
    """The target's aux hidden states, final hidden state and top-k next-token logits at every position."""
    ids = torch.tensor([tokens])
    out = model.base_model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states
    final = hidden[-1][0]
    logits = model.get_output_embeddings()(final)
    values, indices = torch.topk(logits.float(), top_k, dim=-1)
    return {"aux": torch.cat([hidden[i][0] for i in aux_layer_ids], dim=-1).half(), "final": final.half(),
            "topk_ids": indices.int(), "topk_logits": values.half()}


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


def build_features(recipe: Recipe, model: Any, tokenizer: Any, progress: bool = True, *, engine: Any = None) -> Path:
    """Compute (or finish computing) the recipe's feature cache; returns its directory.

    engine: what writes the target's responses when a source is in generate mode: `generate(prompts, **options)`
    returning results with `token_ids`, and `tokenizer` (the runtime's `Engine` over `model`, which the caller wires:
    the training library does not import the runtime).
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
        embed = model.get_input_embeddings().weight.detach().float()
        head = model.get_output_embeddings().weight.detach().float()
        tensors = {"embed_tokens": embed} if head.data_ptr() == embed.data_ptr() else {"embed_tokens": embed,
                                                                                      "lm_head": head}
        _save_atomic(tensors, head_file)

    spec = recipe.data
    responses_cache = None  # only generate-mode items (response None) look into it
    if any(s.mode == "generate" for s in spec.sources):
        if engine is None:
            raise ValueError("the recipe has generate-mode sources: pass engine= (e.g. hybridspec's Engine over the "
                             "target) to write the target's responses")
        fingerprint = target_fingerprint(model)
        responses_cache = ResponseCache(recipe.generated_dir() / f"responses-{fingerprint}-{spec.max_new_tokens}.jsonl")
        for source in spec.sources:
            if source.kind == "self_instruct":
                write_self_instruct(recipe, source, engine, fingerprint, progress)
    items = load_items(recipe)
    for split in SPLITS:
        chunks = [items[split][i: i + spec.shard_size] for i in range(0, len(items[split]), spec.shard_size)]
        todo = [(i, c) for i, c in enumerate(chunks) if not (root / f"{split}-{i:05d}.safetensors").exists()]
        bar = tqdm(total=sum(len(c) for _, c in todo), desc=f"features ({split})", unit="seq", disable=not progress)
        for index, chunk in todo:
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
            for item, prompt, response in zip(chunk, prompts, responses):
                bar.update(1)
                if len(response) < 2:  # nothing a drafter could learn from
                    continue
                parts.append(target_features(model, prompt + response, aux_ids, spec.top_k))
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
