"""Batched text generation on an accelerator, for the training data of `hybridspec gpu-run`.

The runtime's `Engine` is built for CPUs (its attention kernel, its measured products); on a GPU, transformers'
`generate` over a whole batch is the fast way to have the target write its training text. `BatchGenerator` is the
`engine` that `speculators.train.data.build_features` and `text.write_self_instruct` take: `generate(prompts,
max_new_tokens=, temperature=, top_p=, seed=, speculate=)` returning results with `token_ids`, `text` and
`finish_reason`, and `tokenizer`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class Generated:
    token_ids: list[int]   # the response, ending with EOS when the target stopped on it
    text: str              # decoded without the EOS
    finish_reason: str     # "eos" or "length"


class BatchGenerator:
    """Left-padded batches through `model.generate` (greedy, or sampled with temperature / top-p) on the model's device.

    max_batch: rows per `generate` call (a call with more prompts runs several); the prompts are sorted by length
    first so that a batch pads little, and the results come back in the prompts' order."""

    def __init__(self, model: Any, tokenizer: Any, max_batch: int = 512) -> None:
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.generated_tokens = 0
        self.seconds = 0.0

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, speculate: str = "none", **_: Any) -> list[Generated]:
        import time

        start = time.perf_counter()
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[Generated | None] = [None] * len(prompts)
        if seed is not None:
            torch.manual_seed(seed)
        for b in range(0, len(order), self.max_batch):
            rows = order[b: b + self.max_batch]
            for i, result in zip(rows, self._batch([list(prompts[i]) for i in rows], max_new_tokens, temperature,
                                                   top_p)):
                out[i] = result
        self.seconds += time.perf_counter() - start
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
               top_p: float) -> list[Generated]:
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sample = temperature > 0
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, num_beams=1,
                                  temperature=temperature if sample else None, top_p=top_p if sample else None,
                                  top_k=0 if sample else None, pad_token_id=self.pad, eos_token_id=self.eos,
                                  bos_token_id=getattr(self.model.config, "bos_token_id", None))
        new = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
        results = []
        for row in new:
            if self.eos in row:
                row = row[: row.index(self.eos) + 1]
                reason, body = "eos", row[:-1]
            else:
                reason, body = "length", row
            self.generated_tokens += len(row)
            results.append(Generated(row, self.tokenizer.decode(body, skip_special_tokens=True), reason))
        return results
