"""Training text: the prompt sources, their held-out split, and the text the target writes for training (its
self-instruct requests and its greedy responses, cached on disk so a change of data generates only what is new)."""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

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
# the text the target writes


def generate_responses(engine: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy responses of the target (ending with its EOS token when it stopped on one), one batch on the engine."""
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=max_new_tokens, speculate="none")]


def target_fingerprint(model: Any) -> str:
    """Identifies a target's weights (its config, embedding and lm_head) for the caches of text it generated."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h = hashlib.sha1(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        h.update(weight.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def request_header(tokenizer: Any) -> list[int]:
    """The chat template up to where a user's request starts: the target continues it with a request of its own."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self_instruct needs a tokenizer with a chat template")
    marker = "{request}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def write_self_instruct(recipe: Recipe, source: PromptSource, engine: Any, fingerprint: str,
                        progress: bool = True, deadline: float | None = None) -> Path:
    """Have the target write `source.max_items` distinct user requests (sampled at temperature 1, top-p 0.95, from
    its chat template's user-turn header; kept only when it ended the turn itself). Resumable per batch. Past
    `deadline` (time.monotonic()) it stops after the batch in hand and keeps the requests written so far."""
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
        if requests and deadline is not None and time.monotonic() >= deadline:
            break
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
