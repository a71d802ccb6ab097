"""The FastEagle cascade as a vLLM model: vLLM's EAGLE-3 Llama drafter (the same fc, layers, norm, reduced-vocabulary
lm_head and checkpoint names), run so that one pass gives all K drafts.

vLLM's EAGLE proposer with parallel drafting lays out each request as its real slots (fc of the target's aux hidden
states, the next token; the last one carries the token just sampled) followed by K-1 parallel slots (token
`pard_token`, out of the vocabulary for FastEagle), runs the model once over all of them and samples draft j from the
output of the j-th slot after the last real one (j = 0: the last real slot itself). FastEagle's draft j is layer j's
output at the last real slot (`speculators/fasteagle.py`): so every layer runs over every slot as vLLM's EAGLE-3 model
runs them (layer 0 reads cat(norm(embedding), norm(fc(aux))), layer i > 0 layer i-1's output), and the output of
the parallel slot at distance d from its last real slot is layer d's output there. The parallel slots themselves
come after the real ones (causal attention: the real slots never see them) and their keys and values land at
positions the next step's real slots overwrite before anyone reads them, as with P-EAGLE.

The class subclasses vLLM's `Eagle3LlamaForCausalLM`, which vLLM's proposer checks with isinstance for "eagle3".
Pinned with the plugin to vLLM 0.32 (the proposer's slot layout and the EAGLE-3 layer's forward are not public API).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

from hybridspec.vllm_plugin.config import ENV_SWITCH, announce


class FastEagleLlamaForCausalLM(Eagle3LlamaForCausalLM):
    """A FastEagle cascade of L layers drafting K <= L tokens per pass (vLLM's eagle3 with parallel drafting)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        spec = vllm_config.speculative_config
        num_layers = len(self.model.layers)
        if not spec.parallel_drafting:
            raise ValueError('a FastEagle head drafts all its tokens in one pass: use it with "method": "eagle3" and '
                             '"parallel_drafting": true')
        if not 1 <= spec.num_speculative_tokens <= num_layers:
            raise ValueError(f"this FastEagle head drafts at most {num_layers} tokens (one per layer); "
                             f"num_speculative_tokens is {spec.num_speculative_tokens}")
        self.parallel_token = int(self.config.pard_token)
        announce("eagle3", f"hybridspec's FastEagle cascade ({num_layers} layers, K={spec.num_speculative_tokens}, "
                           f"{ENV_SWITCH}=fasteagle)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, pre-norm) outputs of every slot: layer 0's at a real slot, layer d's at the real slot d slots
        before a parallel slot."""
        if input_ids is None:
            raise ValueError("FastEagle needs the token ids (its parallel slots are found by their token)")
        model = self.model
        parallel = input_ids == self.parallel_token
        if inputs_embeds is None:
            inputs_embeds = model.embed_input_ids(torch.where(parallel, torch.zeros_like(input_ids), input_ids))
        index = torch.arange(input_ids.shape[0], device=input_ids.device)
        # the last real slot at or before each slot, and how far behind it is (0 at a real slot)
        anchor = torch.where(parallel, torch.zeros_like(index), index).cummax(0).values
        depth = index - anchor
        out = None
        residual = None
        for d, layer in enumerate(model.layers):
            hidden_states, residual = layer(positions=positions, embeds=inputs_embeds, hidden_states=hidden_states,
                                            residual=residual)
            full = hidden_states + residual  # the layer's output (vLLM's layers carry the residual apart)
            if out is None:
                out = full
            else:
                out = torch.where((depth == d)[:, None], full.index_select(0, anchor), out)
        return model.norm(out), out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's EAGLE-3 loader, with the all-zero `mask_hidden` it asks of a parallel-drafting checkpoint (FastEagle
        has none: what its parallel slots read does not matter)."""
        def with_mask_hidden() -> Iterable[tuple[str, torch.Tensor]]:
            seen = False
            for name, tensor in weights:
                seen = seen or "mask_hidden" in name
                yield name, tensor
            if not seen:
                yield "mask_hidden", torch.zeros(1, self.model.fc_input_size)

        super().load_weights(with_mask_hidden())
