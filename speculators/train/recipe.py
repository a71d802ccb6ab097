"""Training recipes: one YAML file holds the data, the drafter's architecture, the hyper-parameters and the output.

    drafter: peagle            # a kind of speculators.registry: peagle | lstm | eagle3 | fasteagle
    target: smollm2            # "smollm2" or a local Hugging Face model directory
    data: {...}                # DataSpec
    architecture: {...}        # ArchitectureSpec
    training: {...}            # TrainingSpec
    output: {...}              # OutputSpec

Unknown keys are errors (a typo must not silently train something else). Relative paths are relative to the recipe's
directory, `~` is expanded.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridspec.speculators.registry import DRAFTER_KINDS

SOURCE_KINDS = ("agent_traces", "mt_bench", "humaneval", "jsonl", "self_instruct")
# Keys added after runs were made (section, key, default): left out of the state directory's hash at their default.
ADDED_KEYS = (("training", "train_fraction", 1.0), ("architecture", "layers_from_target", False))


def cache_root() -> Path:
    """hybridspec's user cache ($HYBRIDSPEC_CACHE, else ~/.cache/hybridspec): feature caches and resumable state."""
    root = os.environ.get("HYBRIDSPEC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "hybridspec"


@dataclass
class PromptSource:
    """Where prompts (or texts) come from.

    kind: "agent_traces" (user turns of the trace files under path), "mt_bench" (first turns), "humaneval" (function
    prompts), "jsonl" (field `text` of each line), "self_instruct" (no path: the target writes max_items user
    requests itself, sampled from the user-turn header of its chat template, as Magpie does; seed picks them).
    mode: "generate" (the target answers the prompt; the response is trained on) or "text" (the source's own text is
    the training text, with the target's features: for agent traces, the assistant turns). max_items caps how many are
    taken (after deduplication, in a stable order). train_only: every item goes to the training split (e.g. existing
    text, when acceptance is to be measured on the target's own responses only).
    """

    kind: str
    path: str = ""
    mode: str = "generate"
    max_items: int | None = None
    train_only: bool = False
    seed: int = 0


@dataclass
class DataSpec:
    sources: list[PromptSource] = field(default_factory=list)
    heldout_fraction: float = 0.1       # of each source, chosen by a hash of the text: never trained on
    max_prompt_tokens: int = 256        # prompts are cut to this many tokens (head kept)
    max_new_tokens: int = 160           # generated response length cap
    max_text_tokens: int = 384          # "text" items are cut to this many tokens
    generation_batch_size: int = 8
    shard_size: int = 16                # sequences per cached shard (the unit of resumption)
    top_k: int = 8                      # target logits kept per position
    cache_dir: str | None = None        # default: <cache>/features/<hash of target + data settings>


@dataclass
class ArchitectureSpec:
    num_layers: int = 1                 # EAGLE family decoder layers
    intermediate_size: int | None = None  # default: the target's
    draft_vocab_size: int = 8192
    mask_token_id: int | None = None    # P-EAGLE; default: the tokenizer's pad token, else 0
    aux_layer_ids: list[int] | None = None  # default: (2, L//2, L-3)
    norm_before_residual: bool = False
    independent_layers: bool = False    # FastEagle without the cascade: every layer reads the fused features (ablation)
    lm_head_from_target: bool = False   # EAGLE family: start lm_head from the target's rows of the draft vocabulary
    layers_from_target: bool = False    # EAGLE family: start decoder layer i from the target's i-th of its last
                                        # num_layers layers, every weight whose shape matches (`init_from_target`)
    dim: int = 128                      # LSTM inner/proj/emb dimension
    num_speculative_tokens: int = 7     # LSTM heads trained
    scale_input: bool = True            # LSTM: normalise the target hidden state first


@dataclass
class TrainingSpec:
    steps: int = 500
    tokens_per_step: int = 768          # real slots packed into one step
    max_prompt_slots: int | None = None  # prompt context kept before a sequence's first trained-on slot (None: all);
                                        # the prompt's slots are trained on only as context the drafter attends to
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_depth: int = 7                  # chain depth trained (P-EAGLE parallel depths, EAGLE-3 TTT steps, LSTM heads)
    keep_ratio: float = 0.7             # per-depth chain sampling (P-EAGLE, LSTM): ~n * max(keep^d, min) at depth d
    min_ratio: float = 0.2
    sample_chains: bool = True          # False: every chain to every depth (EAGLE-3's training-time test)
    depth_weights: list[float] | None = None  # the loss's weight of each depth (normalised; None: all equal)
    feature_weight: float = 0.0         # FastEagle: weight of the Smooth-L1 between each layer's normed output and
                                        # the target's final hidden state at the position it drafts
    eval_every: int = 100
    save_every: int = 50
    eval_ks: list[int] = field(default_factory=lambda: [3, 5, 7])
    eval_max_sequences: int | None = None  # held-out sequences evaluated, evenly spaced (None: all)
    train_fraction: float = 1.0         # train on this fixed random share of the training sequences (data scaling)
    seed: int = 0
    threads: int = 1                    # more OpenMP threads than free cores slows training down, not up


@dataclass
class OutputSpec:
    dir: str = "checkpoints/drafter"
    dtype: str = "bfloat16"             # weights as written; training runs in float32
    state_dir: str | None = None        # resumable state; default: <cache>/train/<recipe hash>
    resume: bool = True
    verifier: str | None = None         # the target's name recorded in the checkpoint (e.g. a hub id); default: target
    compact: bool = False               # 8-bit model.safetensors.q8 (speculators/quantize.py), as the shipped heads


@dataclass
class Recipe:
    drafter: str
    target: str = "smollm2"
    data: DataSpec = field(default_factory=DataSpec)
    architecture: ArchitectureSpec = field(default_factory=ArchitectureSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    base_dir: str = "."                 # the recipe's directory (relative paths resolve against it)

    def path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def data_key(self) -> str:
        """Identifies the cached features: the target, every data setting and the aux layers they hold."""
        spec = dataclasses.asdict(self.data)
        spec.pop("cache_dir")
        spec.pop("generation_batch_size")
        for source in spec["sources"]:
            source["path"] = str(self.path(source["path"]).resolve()) if source["path"] else ""
        blob = json.dumps({"target": self.target, "data": spec, "aux_layer_ids": self.architecture.aux_layer_ids},
                          sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def feature_dir(self) -> Path:
        if self.data.cache_dir:
            return self.path(self.data.cache_dir)
        return cache_root() / "features" / self.data_key()

    def generated_dir(self) -> Path:
        """Text the target generated (self-instruct requests, responses), kept beside the feature caches so that a
        change of the data section reuses it instead of generating it again."""
        base = self.path(self.data.cache_dir).parent if self.data.cache_dir else cache_root()
        return base / "generated"

    def state_dir(self) -> Path:
        if self.output.state_dir:
            return self.path(self.output.state_dir)
        # Everything that shapes the training run, not where or how its result is written.
        shape = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("base_dir", "output")}
        del shape["training"]["threads"]  # how fast, not what
        for section, key, default in ADDED_KEYS:  # at their defaults, earlier runs' states keep their place
            if shape[section][key] == default:
                del shape[section][key]
        blob = json.dumps(shape, sort_keys=True)
        return cache_root() / "train" / hashlib.sha1(blob.encode()).hexdigest()[:12]

    def output_dir(self) -> Path:
        return self.path(self.output.dir)


def _build(cls: type, value: Any, where: str) -> Any:
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, got {type(value).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {unknown}; allowed: {sorted(names)}")
    return cls(**value)


def recipe_from_dict(raw: dict[str, Any], base_dir: str | os.PathLike = ".") -> Recipe:
    if not isinstance(raw, dict):
        raise ValueError("a recipe must be a YAML mapping")
    allowed = {"drafter", "target", "data", "architecture", "training", "output"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"unknown top-level recipe key(s): {unknown}; allowed: {sorted(allowed)}")
    if raw.get("drafter") not in DRAFTER_KINDS:
        raise ValueError(f"recipe 'drafter' must be one of {DRAFTER_KINDS}, got {raw.get('drafter')!r}")
    if isinstance(raw.get("architecture"), dict) and "n_predict" in raw["architecture"]:
        raise ValueError("architecture.n_predict is now called architecture.num_speculative_tokens (n_predict remains "
                         "only the Arctic checkpoint's field)")
    data_raw = dict(raw.get("data") or {})
    sources = [_build(PromptSource, s, "data.sources[]") for s in data_raw.pop("sources", [])]
    for s in sources:
        if s.kind not in SOURCE_KINDS or s.mode not in ("generate", "text"):
            raise ValueError(f"bad data source {s}: kind must be {'|'.join(SOURCE_KINDS)}, mode generate|text")
        if s.kind == "self_instruct" and (s.mode != "generate" or not s.max_items):
            raise ValueError(f"bad data source {s}: self_instruct needs mode generate and max_items (how many "
                             "requests the target writes)")
        if s.kind != "self_instruct" and not s.path:
            raise ValueError(f"bad data source {s}: {s.kind} needs a path")
    data = _build(DataSpec, data_raw, "data")
    data.sources = sources
    if not 0.0 < data.heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction must be in (0, 1), got {data.heldout_fraction}")
    training = _build(TrainingSpec, raw.get("training"), "training")
    if training.max_prompt_slots is not None and training.max_prompt_slots < 0:
        raise ValueError(f"training.max_prompt_slots must be >= 0 (or null: the whole prompt), got "
                         f"{training.max_prompt_slots}")
    if training.max_depth < max(training.eval_ks, default=1):
        raise ValueError(f"training.max_depth {training.max_depth} < the largest eval K {max(training.eval_ks)}")
    if training.depth_weights is not None and (len(training.depth_weights) != training.max_depth
                                               or min(training.depth_weights) < 0 or sum(training.depth_weights) <= 0):
        raise ValueError(f"training.depth_weights needs max_depth ({training.max_depth}) weights >= 0, not all 0; "
                         f"got {training.depth_weights}")
    if not 0.0 < training.train_fraction <= 1.0:
        raise ValueError(f"training.train_fraction must be in (0, 1], got {training.train_fraction}")
    architecture = _build(ArchitectureSpec, raw.get("architecture"), "architecture")
    fasteagle = raw["drafter"] == "fasteagle"
    if training.feature_weight < 0 or (training.feature_weight and not fasteagle):
        raise ValueError(f"training.feature_weight (got {training.feature_weight}) is FastEagle's and must be >= 0")
    if architecture.layers_from_target and raw["drafter"] == "lstm":
        raise ValueError("architecture.layers_from_target starts decoder layers: the LSTM speculator has none")
    if architecture.independent_layers and not fasteagle:
        raise ValueError("architecture.independent_layers is FastEagle's no-cascade ablation")
    if fasteagle and architecture.num_layers < training.max_depth:
        raise ValueError(f"FastEagle drafts one token per layer: architecture.num_layers ({architecture.num_layers}) "
                         f"must be >= training.max_depth ({training.max_depth})")
    return Recipe(drafter=raw["drafter"], target=str(raw.get("target", "smollm2")), data=data,
                  architecture=architecture, training=training, output=_build(OutputSpec, raw.get("output"), "output"),
                  base_dir=str(base_dir))


def load_recipe(path: str | os.PathLike) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no recipe at {path}")
    return recipe_from_dict(yaml.safe_load(path.read_text()), base_dir=path.parent.resolve())
