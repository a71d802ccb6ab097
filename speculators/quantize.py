"""The compact on-disk form of drafter weights: 8-bit matrices with one scale per output row.

A floating 2-D tensor of at least `MIN_DIM` rows and columns (the projections, MLPs, heads and the LSTM's embedding) is
stored as `NAME.q8` (int8 [rows, cols]) and `NAME.q8_scale` (bfloat16 [rows]): NAME = q8 * scale, the
scale being the row's largest magnitude / 127 (rounded to bfloat16 first, so that the int8 values round against the
scale actually stored). Other floating tensors (norms, biases, P-EAGLE's mask_hidden) are stored in bfloat16; integer
and boolean tensors (d2t, t2d) as they are. The safetensors metadata says `hybridspec_weights: int8-rowwise`. Read back,
a matrix is q8 * scale rounded to bfloat16, whatever the dtype asked for: a compact head and the bfloat16
model.safetensors expanded from it load to the same weights.

Only the runtime reads this form (`load_drafter` dequantizes in memory); vLLM reads model.safetensors, which
`formats.expand_checkpoint` writes from it.
"""
from __future__ import annotations

import torch
from torch import Tensor

FORMAT = "int8-rowwise"
QUANT, SCALE = ".q8", ".q8_scale"
MIN_DIM = 16  # narrower matrices (P-EAGLE's mask_hidden, [1, 3H]) stay in bfloat16: not worth their scales


def quantizable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dim() == 2 and min(tensor.shape) >= MIN_DIM


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 [rows, cols], bfloat16 scale [rows]) with weight ~= q.float() * scale[:, None]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).to(torch.bfloat16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.clamp(torch.round(w / safe[:, None]), -127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q * scale rounded to bfloat16, then cast to dtype: the values of the expanded model.safetensors."""
    return (q.float() * scale.float()[:, None]).to(torch.bfloat16).to(dtype)


def quantize(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The compact form of a state dict (see the module's docstring)."""
    out: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith((QUANT, SCALE)):
            raise ValueError(f"a weight named {name!r} would be read back as part of a quantized matrix")
        tensor = tensor.detach().cpu()
        if quantizable(tensor):
            out[name + QUANT], out[name + SCALE] = quantize_rows(tensor)
        elif tensor.is_floating_point():
            out[name] = tensor.to(torch.bfloat16).contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def dequantize(stored: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The state dict back from its compact form, floating tensors in `dtype`."""
    out: dict[str, Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(SCALE):
            if name[: -len(SCALE)] + QUANT not in stored:
                raise ValueError(f"{name} has no matching {QUANT} matrix")
            continue
        if name.endswith(QUANT):
            base = name[: -len(QUANT)]
            if base + SCALE not in stored:
                raise ValueError(f"{name} has no {SCALE}")
            out[base] = dequantize_rows(tensor, stored[base + SCALE], dtype)
        else:
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out
