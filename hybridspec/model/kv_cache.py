"""The target model's KV cache: B rows in one preallocated tensor, each with its own length; and the attention mask of
a step's [last token] + draft nodes (chains and trees alike)."""
from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    """Keys and values of B sequences: [layers, B, kv_heads, capacity, head_dim]; row b holds lengths[b] tokens.

    Slots at or beyond a row's length are scratch: a step writes its input tokens there, and `commit` decides which of
    them become part of the sequence. The tensors are inference tensors: every method that writes them runs in
    inference mode.
    """

    @torch.inference_mode()
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch_size

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @torch.inference_mode()
    def reserve(self, capacity: int, *, exact: bool = False) -> None:
        """Grow every row to hold at least `capacity` tokens (doubling, to amortise the copy; `exact`: no more than
        that, for a cache that is kept after its call)."""
        if capacity <= self.capacity:
            return
        new_capacity = capacity if exact else max(capacity, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:3] + (new_capacity,) + old.shape[4:])
            new[:, :, :, : old.shape[3]] = old
            new[:, :, :, old.shape[3]:] = 0  # scratch slots are read under a mask: zero, never NaN (the rest is copied)
            setattr(self, name, new)

    @torch.inference_mode()
    def commit(self, row: int, keep: Sequence[int]) -> None:
        """Make the step's input slots `keep` (indices into that step's q inputs, increasing) the row's next tokens.

        keep = [0, 1, ..., m-1] (a chain's accepted prefix) needs no copy: the rejected slots are simply past the new
        length. Otherwise (a tree path) the kept slots are gathered into consecutive positions.
        """
        base = self.lengths[row]
        if list(keep) != list(range(len(keep))):
            src = torch.as_tensor(keep, dtype=torch.long, device=self.keys.device) + base
            dst = torch.arange(base, base + len(keep), device=self.keys.device)
            # Advanced indexing on the right-hand side copies before the write, so overlapping slots are safe.
            self.keys[:, row, :, dst] = self.keys[:, row, :, src]
            self.values[:, row, :, dst] = self.values[:, row, :, src]
        self.lengths[row] = base + len(keep)

    def truncate(self, row: int, length: int) -> None:
        """Drop a row's tokens beyond `length` (e.g. to re-run a prompt suffix)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    @torch.inference_mode()
    def copy_prefix(self, row: int, source: "KVCache", source_row: int, length: int, start: int = 0) -> None:
        """Make this row the first `length` tokens of `source`'s row `source_row` (a prefix cache hit); with `start`,
        the row's first `start` tokens are those already and only the rest is copied."""
        if length > min(source.lengths[source_row], self.capacity) or not 0 <= start <= min(length, self.lengths[row]):
            raise ValueError(f"cannot copy tokens {start}..{length}: the source row holds "
                             f"{source.lengths[source_row]}, this row {self.lengths[row]} of {self.capacity}")
        self.keys[:, row, :, start:length] = source.keys[:, source_row, :, start:length]
        self.values[:, row, :, start:length] = source.values[:, source_row, :, start:length]
        self.lengths[row] = length

    @torch.inference_mode()
    def row(self, row: int) -> "KVCache":
        """A one-row cache with a copy of this row's tokens, sized to them."""
        length = self.lengths[row]
        shape = self.keys.shape
        copy = KVCache(shape[0], 1, shape[2], shape[4], max(length, 1), self.keys.dtype, self.keys.device)
        copy.copy_prefix(0, self, row, length)
        return copy

    @torch.inference_mode()
    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order (sequences that finished leave the batch)."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.keys.device)
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        self.lengths = [self.lengths[r] for r in rows]


def tree_depths_and_mask(parents: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """Depth of each input slot and the ancestor-or-self mask [1 + n, 1 + n] for `[last token] + nodes`.

    Slot 0 is the last committed token; node i is slot i + 1 and its parent p is slot p + 1 (-1 -> slot 0).
    """
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    depth = [0] * (n + 1)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must precede its child (or be -1)")
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
        depth[i + 1] = depth[p + 1] + 1
    return depth, mask
