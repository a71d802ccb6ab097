"""The training loop shared by the drafters: packed batches of real slots (`batches.py`), chains sampled per depth,
the loss of each drafter, periodic evaluation of acceptance length on held-out text (`evaluation.py`), resumable
checkpoints.
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from hybridspec.model.machine import machine_info
from hybridspec.speculators.chains import ChainLayout, full_chain_origins, sample_chain_origins
from hybridspec.speculators.eagle import EagleBase, EagleConfig
from hybridspec.speculators.features import build_draft_vocab
from hybridspec.speculators.formats import save_drafter
from hybridspec.speculators.layers import LayerConfig
from hybridspec.speculators.lstm import LSTMConfig
from hybridspec.speculators.registry import drafter_kind
from hybridspec.speculators.train.batches import Batch, chain_logits, first_slot, make_batch
from hybridspec.speculators.train.data import FeatureStore, load_target_head
from hybridspec.speculators.train.evaluation import evaluate_acceptance, predicted_ids, spread
from hybridspec.speculators.train.recipe import Recipe

STATE_FILE = "train_state.pt"


def build_drafter(recipe: Recipe, meta: dict[str, Any], embed: Tensor) -> Any:
    arch, cfg = recipe.architecture, SimpleNamespace(**meta["config"])
    kind = drafter_kind(recipe.drafter)
    if kind.config is LSTMConfig:
        config = LSTMConfig(input_hidden_dim=meta["hidden_size"], dim=arch.dim, vocab_size=meta["vocab_size"],
                            num_speculative_tokens=arch.num_speculative_tokens, scale_input=arch.scale_input)
        return kind.drafter(config)
    mask_token = arch.mask_token_id
    if mask_token is None:
        mask_token = meta.get("pad_token_id") or 0
    eagle = EagleConfig(layer=LayerConfig.like_target(cfg, arch.intermediate_size), num_layers=arch.num_layers,
                        target_hidden_size=meta["hidden_size"], target_vocab_size=meta["vocab_size"],
                        draft_vocab_size=arch.draft_vocab_size, aux_layer_ids=tuple(meta["aux_layer_ids"]),
                        norm_before_residual=arch.norm_before_residual, independent_layers=arch.independent_layers,
                        mask_token_id=mask_token if recipe.drafter == "peagle" else None,
                        num_speculative_tokens=max(recipe.training.eval_ks))
    return kind.drafter(eagle, embed_tokens=embed)


def init_from_target(drafter: Any, target_layers: Sequence[Mapping[str, Tensor]]) -> list[str]:
    """Copy into drafter layer i every weight of target_layers[i] (a decoder layer's state dict, transformers' names:
    self_attn.q_proj.weight, mlp.up_proj.weight, input_layernorm.weight, ...) that the drafter's layer has with the
    same shape; returns the names copied. The rest (a first layer's 2H-wide projections, smaller MLPs) keeps its
    random start."""
    if len(target_layers) < len(drafter.layers):
        raise ValueError(f"{len(target_layers)} target layers for a drafter of {len(drafter.layers)}")
    copied = []
    with torch.no_grad():
        for i, (layer, source) in enumerate(zip(drafter.layers, target_layers)):
            own = dict(layer.named_parameters())
            for name, value in source.items():
                if name in own and own[name].shape == value.shape:
                    own[name].copy_(value)
                    copied.append(f"layers.{i}.{name}")
    return copied


class Trainer:
    """Trains a recipe's drafter on its feature cache. target_layers: the target's last decoder layers' state dicts,
    for architecture.layers_from_target (`hybridspec train` loads them). device: where the drafter trains (batches
    and chains are built on the CPU and moved there)."""

    def __init__(self, recipe: Recipe, feature_dir: str | os.PathLike, progress: bool = True,
                 target_layers: Sequence[Mapping[str, Tensor]] | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.recipe, self.progress, self.device = recipe, progress, torch.device(device)
        t = recipe.training
        torch.manual_seed(t.seed)
        self.train = FeatureStore(feature_dir, "train")
        self.heldout = FeatureStore(feature_dir, "heldout")
        self.meta = self.train.meta
        embed, lm_head = load_target_head(feature_dir)
        self.drafter = build_drafter(recipe, self.meta, embed)
        self.is_eagle = isinstance(self.drafter, EagleBase)
        # The sequences trained on: all, or a fixed random share (train_fraction, for data scaling) whose shares
        # nest: a smaller share is a subset of a larger one. Nothing else (the draft vocabulary included) sees more.
        share = max(1, round(t.train_fraction * len(self.train)))
        self.pool = (torch.arange(len(self.train)) if share == len(self.train) else torch.randperm(
            len(self.train), generator=torch.Generator().manual_seed(t.seed + 1))[:share].sort().values)
        if self.is_eagle:
            d2t, t2d = build_draft_vocab(self.train.response_target_counts(self.meta["vocab_size"], self.pool.tolist()),
                                         recipe.architecture.draft_vocab_size)
            self.drafter.set_draft_vocab(d2t, t2d)
            # The target's lm_head rows of the draft vocabulary: KL targets over the draft vocabulary.
            self.draft_head = lm_head[self.drafter.draft_to_target()].float()
            if recipe.architecture.lm_head_from_target:
                with torch.no_grad():
                    self.drafter.lm_head.weight.copy_(self.draft_head)
        self.layers_copied: list[str] = []
        if recipe.architecture.layers_from_target:
            if target_layers is None:
                raise ValueError("architecture.layers_from_target needs the target's layers (target_layers=; "
                                 "`hybridspec train` passes them)")
            self.layers_copied = init_from_target(self.drafter, target_layers)
        weights = torch.tensor(t.depth_weights or [1.0] * t.max_depth)
        self.depth_weights = (weights / weights.sum()).to(self.device)
        self.drafter.to(self.device)
        if self.is_eagle:
            self.draft_head = self.draft_head.to(self.device)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
        self.generator = torch.Generator().manual_seed(t.seed)
        self.step, self.elapsed, self.history, self.slots = 0, 0.0, [], 0  # slots: real slots trained on so far
        self.epoch, self.cursor, self.order = 0, 0, self.shuffled_pool()
        self.state_dir = recipe.state_dir()

    # -- schedule and batches -----------------------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        t = self.recipe.training
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def shuffled_pool(self) -> Tensor:
        return self.pool[torch.randperm(len(self.pool), generator=self.generator)]

    @property
    def train_tokens(self) -> int:
        """Tokens of the sequences trained on."""
        return sum(self.train.spans[i][1] - self.train.spans[i][0] for i in self.pool.tolist())

    def next_batch(self) -> Batch:
        t = self.recipe.training
        chosen, slots = [], 0
        while slots < t.tokens_per_step:
            if self.cursor >= len(self.order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self.shuffled_pool()
            index = int(self.order[self.cursor])
            self.cursor += 1
            start, end, rs = self.train.spans[index]
            chosen.append(index)
            slots += max(0, end - start - 2 - first_slot((start, end, rs), t.tokens_per_step, t.max_prompt_slots))
        return make_batch(self.train, chosen, t.tokens_per_step, t.max_depth, t.max_prompt_slots)

    def layout(self, batch: Batch, sample: bool) -> ChainLayout:
        """Chains only from slots whose deepest element has a trained-on target: the others (inside the prompt) would
        run and then be masked out of the loss. The EAGLE family still reads every real slot at depth 0, as context."""
        t = self.recipe.training
        slots = torch.arange(len(batch))
        trained = slots[batch.loss_mask[slots + batch.valid_depth]]
        if sample:
            origins = sample_chain_origins(batch.valid_depth, t.max_depth, t.keep_ratio, t.min_ratio, self.generator,
                                           trained)
        else:
            origins = full_chain_origins(batch.valid_depth, t.max_depth, trained)
        if self.is_eagle:
            origins[0] = slots
        layout = ChainLayout(seq_id=batch.seq_id, positions=batch.positions, origins=origins)
        return layout if self.device.type == "cpu" else layout.to(self.device)

    # -- loss ---------------------------------------------------------------------------------------------------------

    def loss(self, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        """Sum over depths of depth_weights[d] x depth d's masked mean loss (by default every depth weighs the same, as
        in P-EAGLE); with feature_weight, each depth's loss adds that times the Smooth-L1 of its normed output
        against the target's final hidden state (FastEagle)."""
        t = self.recipe.training
        layout = self.layout(batch, t.sample_chains)
        batch = batch if self.device.type == "cpu" else batch.to(self.device)
        hidden = None
        if t.feature_weight:
            hidden = self.drafter.chain_hidden(batch.aux, batch.next_tokens, layout)
            logits = [self.drafter.lm_head(self.drafter.norm(h)) for h in hidden]
        else:
            logits = chain_logits(self.drafter, batch, layout)
        weights = self.depth_weights[: len(logits)] / self.depth_weights[: len(logits)].sum()
        if self.is_eagle:
            with torch.no_grad():
                target_logp = torch.log_softmax(batch.target_final @ self.draft_head.T, dim=-1)
        total, metrics = 0.0, {}
        for d, (lg, origins) in enumerate(zip(logits, layout.origins)):
            slots = origins + d
            mask = batch.loss_mask[slots].float()
            if self.is_eagle:  # KL(target || draft) over the draft vocabulary
                tl = target_logp[slots]
                per = (tl.exp() * (tl - torch.log_softmax(lg, dim=-1))).sum(-1)
            else:              # per-head cross-entropy on the target's greedy token
                per = F.cross_entropy(lg, batch.target_top1[slots], reduction="none")
            if hidden is not None:
                aligned = F.smooth_l1_loss(self.drafter.norm(hidden[d]), batch.target_final[slots], reduction="none")
                per = per + t.feature_weight * aligned.mean(-1)
            count = mask.sum().clamp(min=1.0)
            total = total + weights[d] * (per * mask).sum() / count
            with torch.no_grad():
                correct = (predicted_ids(self.drafter, lg) == batch.target_top1[slots]).float()
                metrics[f"acc{d}"] = float((correct * mask).sum() / count)
        metrics["loss"] = float(total.detach())
        return total, metrics

    def train_step(self) -> dict[str, float]:
        self.drafter.train()
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.next_batch()
        self.slots += len(batch)
        loss, metrics = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.recipe.training.grad_clip)
        self.optimizer.step()
        self.step += 1
        return metrics

    # -- evaluation ---------------------------------------------------------------------------------------------------

    def evaluate(self, store: FeatureStore | None = None, ks: list[int] | None = None) -> dict[str, Any]:
        """Acceptance on the held-out split (or `store`); see evaluate_acceptance."""
        store = store or self.heldout
        indices = spread(len(store), self.recipe.training.eval_max_sequences)
        slots = max(64, self.recipe.training.tokens_per_step // (1 if self.is_eagle else 4))
        return evaluate_acceptance(self.drafter, store, ks or self.recipe.training.eval_ks, indices, slots)

    # -- state --------------------------------------------------------------------------------------------------------

    def trainable_state(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.drafter.state_dict().items() if not k.startswith("embed_tokens.")}

    def save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {"step": self.step, "elapsed": self.elapsed, "history": self.history, "slots": self.slots,
                 "model": self.trainable_state(),
                 "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                 "torch_rng": torch.get_rng_state(), "epoch": self.epoch, "cursor": self.cursor, "order": self.order}
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_dir / STATE_FILE)

    def load_state(self) -> bool:
        file = self.state_dir / STATE_FILE
        if not file.exists():
            return False
        state = torch.load(file, weights_only=False)
        missing, unexpected = self.drafter.load_state_dict(state["model"], strict=False)
        if unexpected or any(not m.startswith("embed_tokens.") for m in missing):
            raise ValueError(f"{file} does not fit this recipe's drafter; remove it or set output.resume: false")
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.elapsed, self.history = state["step"], state["elapsed"], state["history"]
        self.slots = state["slots"]
        self.epoch, self.cursor, self.order = state["epoch"], state["cursor"], state["order"]
        return True

    # -- the run ------------------------------------------------------------------------------------------------------

    def run(self, max_steps: int | None = None, deadline: float | None = None) -> dict[str, Any]:
        """Train to recipe.training.steps (or stop after max_steps more, e.g. to test resumption, or once
        time.monotonic() passes deadline), evaluating and saving periodically; on completion write the checkpoint and
        train_log.json to the output directory."""
        t = self.recipe.training
        torch.set_num_threads(t.threads)
        if self.recipe.output.resume:
            self.load_state()
        stop = t.steps if max_steps is None else min(t.steps, self.step + max_steps)
        bar = tqdm(total=t.steps, initial=self.step, desc=f"train {self.recipe.drafter}", disable=not self.progress)
        since_save = time.perf_counter()
        final_eval = None  # the last step's evaluation, when this process ran it
        while self.step < stop:
            if deadline is not None and time.monotonic() >= deadline:
                stop = self.step  # stopped by the deadline: what was trained is saved below
                self.elapsed += time.perf_counter() - since_save
                since_save = time.perf_counter()
                self.save_state()
                break
            metrics = self.train_step()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc0']:.2f}")
            record: dict[str, Any] = {"step": self.step, "slots": self.slots,
                                      **{k: round(v, 4) for k, v in metrics.items()}}
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                record["eval"] = self.evaluate()
                final_eval = record["eval"] if self.step == t.steps else None
                bar.write(f"step {self.step}: " + ", ".join(f"{k} {v:.3f}" for k, v in record["eval"].items()
                                                           if k.startswith("acceptance")))
            self.history.append(record)
            if self.step % t.save_every == 0 or self.step == stop:
                now = time.perf_counter()
                self.elapsed += now - since_save
                since_save = now
                self.save_state()
        bar.close()
        self.elapsed += time.perf_counter() - since_save
        result = {"step": self.step, "done": self.step >= t.steps}
        if result["done"]:
            result["final_eval"] = final_eval or self.evaluate()
            self.write_output(result["final_eval"])
        return result

    def write_output(self, final_eval: dict[str, Any]) -> Path:
        out = self.recipe.output_dir()
        dtype = getattr(torch, self.recipe.output.dtype)
        drafter = self.drafter if self.device.type == "cpu" else copy.deepcopy(self.drafter).to("cpu")
        save_drafter(drafter, out, dtype=dtype,
                     verifier_name_or_path=self.recipe.output.verifier or self.recipe.target,
                     verifier_architectures=self.meta.get("architectures", []), compact=self.recipe.output.compact)
        log = {"drafter": self.recipe.drafter, "target": self.recipe.target, "steps": self.step,
               "train_seconds": round(self.elapsed, 1), "train_sequences": len(self.pool),
               "train_tokens": self.train_tokens, "heldout_sequences": len(self.heldout),
               "heldout_tokens": self.heldout.num_tokens, "final_eval": final_eval, "machine": machine_info(),
               "layers_from_target": self.layers_copied,
               "recipe": {k: v for k, v in asdict(self.recipe).items() if k != "base_dir"},
               "history": [h for h in self.history if "eval" in h]}
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        return out
