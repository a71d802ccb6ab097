"""The target model's KV cache: B rows in one preallocated tensor, each with its own length; the keys and values of
sliding-window layers in a ring of their window's size, and the recurrent state of linear-attention layers where the
model has them; and the attention mask of a step's [last token] + draft nodes (chains and trees alike)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hybridspec.model.linear import KERNEL_ROWS, _products
from hybridspec.model.machine import ask_for_huge_pages

DELTA_KERNEL = KERNEL_ROWS > 0  # the delta rule's step kernel, in the product kernel's extension (AVX-512 CPUs)


@dataclass(frozen=True)
class RecurrentShape:
    """The state a Gated DeltaNet layer keeps per row: the last conv_width inputs of its causal convolution
    ([channels, conv_width], the model's dtype) and its recurrent state ([heads, key_dim, value_dim], float32)."""

    layers: int
    channels: int
    conv_width: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_row(self) -> int:
        return self.layers * (self.channels * self.conv_width * self.dtype.itemsize
                              + self.heads * self.key_dim * self.value_dim * 4)


@dataclass(frozen=True)
class RingShape:
    """The sliding-window layers of a model, whose keys and values a cache keeps in a ring: position p in slot
    p % size, size = window - 1 + slack, where slack is the most inputs a pass writes (the ring grows to fit a pass
    with more: `KVCache.reserve_inputs`). window: the largest of the layers' windows."""

    layers: int
    window: int
    slack: int = 64

    def bytes_per_row(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * self.layers * kv_heads * (self.window - 1 + self.slack) * head_dim * dtype.itemsize


@dataclass
class PendingNodes:
    """What a pass computed at each row's step inputs (nodes) of the linear-attention layers, all layers stacked:
    enough to replay any root-to-node path onto the rows' states (`KVCache.commit`) without keeping a state per node.
    inputs [layers, b, n, channels] (the convolution's), keys [layers, b, n, heads, key_dim] (normalised), values
    [.., value_dim], decays and betas [layers, b, n, heads]. chain_ends: where every row is a chain, each layer's
    states [b, heads, key_dim, value_dim] after its last node (a plain step's, a fully accepted draft's: no replay)."""

    inputs: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    decays: torch.Tensor
    betas: torch.Tensor
    chain_ends: list[torch.Tensor | None]


def delta_update(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                 beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule: state [..., heads, key_dim, value_dim] decayed by exp(decay), then corrected
    towards value along key by beta: S <- a S + beta k (v - a S^T k)^T, a = exp(decay). Float32 throughout. The
    reference form of `delta_step`."""
    state = state * decay.exp()[..., None, None]
    delta = (value - (state * key[..., None]).sum(-2)) * beta[..., None]
    return state + key[..., None] * delta[..., None, :]


def delta_step(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
               into: torch.Tensor | None = None, query: torch.Tensor | None = None,
               output: torch.Tensor | None = None) -> torch.Tensor:
    """`delta_update` of states [rows, heads, key_dim, value_dim] (key [rows, heads, key_dim], ...) into `into` (a
    tensor of their shape, which may be `state` itself; by default a new one), returned; with `query` [rows, heads,
    key_dim], also each head's output S'^T q into `output` [rows, heads, value_dim]. On an AVX-512 CPU by the kernel
    (`delta_kernel.h`: each state read and written once); elsewhere by `delta_update`."""
    into = torch.empty_like(state) if into is None else into
    rows, heads, key_dim, value_dim = state.shape
    inner = (key_dim * value_dim, value_dim, 1)
    if (DELTA_KERNEL and state.dtype == torch.float32 and state.device.type == "cpu" and value_dim % 16 == 0
            and value_dim <= _products.DELTA_MAX_VALUE_DIM and state.stride()[1:] == inner
            and into.stride()[1:] == state.stride()[1:] and (query is None or output.is_contiguous())):
        key, value, decay, beta = (t.contiguous() for t in (key, value, decay, beta))
        query = None if query is None else query.contiguous()
        _products.delta_step(state.data_ptr(), state.stride(0), into.data_ptr(), into.stride(0), key.data_ptr(),
                             value.data_ptr(), decay.data_ptr(), beta.data_ptr(),
                             0 if query is None else query.data_ptr(), 0 if query is None else output.data_ptr(),
                             rows, heads, key_dim, value_dim, torch.get_num_threads())
        return into
    into.copy_(delta_update(state, key, value, decay, beta))
    if query is not None:
        output.copy_((into * query[..., None]).sum(-2))
    return into


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.empty, in huge pages on a CPU (`ask_for_huge_pages`): a cache is megabytes written all at once."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.device.type == "cpu":
        ask_for_huge_pages(out.data_ptr(), out.nbytes)
    return out


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return _empty(shape, dtype, device).zero_()


class KVCache:
    """Keys and values of B sequences: [attention layers, B, kv_heads, capacity, head_dim]; row b holds lengths[b]
    tokens. With `ring`, the sliding-window layers' keys and values are apart, in a ring of a window's size
    (`RingShape`): `ring_keys` and `ring_values` [layers, B, kv_heads, ring size, head_dim], position p in slot
    p % size; `ring_from[b]`: the oldest position row b's ring still holds. With `recurrent`, each row also holds the
    state of the model's linear-attention layers after its tokens: `conv` [layers, B, channels, conv_width] and
    `state` [layers, B, heads, key_dim, value_dim].

    Slots at or beyond a row's length are scratch: a step writes its input tokens there, and `commit` decides which of
    them become part of the sequence. A ring's scratch slots are those of its oldest positions past the window. A
    recurrent state has no slots: a pass leaves what it computed at the step's nodes in `pending` and `commit` replays
    the accepted path onto the state (a prompt's tokens, always kept, update it during the pass). Such a cache cannot
    go back to a shorter length, nor a ring further back than it holds. The tensors are inference tensors: every
    method that writes them runs in inference mode.
    """

    @torch.inference_mode()
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", recurrent: RecurrentShape | None = None,
                 ring: RingShape | None = None):
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.keys, self.values = _zeros(shape, dtype, device), _zeros(shape, dtype, device)
        self.lengths = [0] * batch_size
        self.recurrent, self.ring = recurrent, ring
        self.conv = self.state = self.ring_keys = self.ring_values = None
        if recurrent is not None:
            r = recurrent
            self.conv = torch.zeros(r.layers, batch_size, r.channels, r.conv_width, dtype=r.dtype, device=device)
            self.state = torch.zeros(r.layers, batch_size, r.heads, r.key_dim, r.value_dim, device=device)
        if ring is not None:
            ring_shape = (ring.layers, batch_size, num_kv_heads, ring.window - 1 + ring.slack, head_dim)
            self.ring_keys, self.ring_values = _zeros(ring_shape, dtype, device), _zeros(ring_shape, dtype, device)
        self.ring_from = [0] * batch_size
        self.pending: PendingNodes | None = None

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def ring_size(self) -> int:
        return 0 if self.ring is None else self.ring_keys.shape[3]

    @property
    def nbytes(self) -> int:
        states = 0 if self.recurrent is None else self.conv.nbytes + self.state.nbytes
        rings = 0 if self.ring is None else self.ring_keys.nbytes + self.ring_values.nbytes
        return self.keys.nbytes + self.values.nbytes + states + rings

    @torch.inference_mode()
    def reserve_inputs(self, inputs: int) -> None:
        """Grow the ring (if any) to take a pass of `inputs` inputs per row without overwriting a key in any of their
        windows: size >= window - 1 + inputs (doubling the slack). The positions each row's ring holds move along."""
        if self.ring is None or self.ring_size >= self.ring.window - 1 + inputs:
            return
        old_size = self.ring_size
        size = self.ring.window - 1 + max(inputs, 2 * (old_size - self.ring.window + 1))
        for name in ("ring_keys", "ring_values"):
            old = getattr(self, name)
            new = _zeros(old.shape[:3] + (size,) + old.shape[4:], old.dtype, old.device)
            for row, length in enumerate(self.lengths):
                held = torch.arange(max(self.ring_from[row], length - old_size), length, device=old.device)
                new[:, row, :, held % size] = old[:, row, :, held % old_size]
            setattr(self, name, new)

    def _ring_holds(self, row: int, length: int) -> bool:
        """Whether row's ring holds the window before `length` (what the next token at `length` attends to)."""
        return self.ring is None or max(0, length - self.ring.window + 1) >= self.ring_from[row]

    def note_ring_writes(self, row: int, end: int) -> None:
        """A pass wrote row's ring up to position end - 1: the positions a ring's size before are gone."""
        if self.ring is not None:
            self.ring_from[row] = max(self.ring_from[row], end - self.ring_size)

    @torch.inference_mode()
    def reserve(self, capacity: int, *, exact: bool = False) -> None:
        """Grow every row to hold at least `capacity` tokens (doubling, to amortise the copy; `exact`: no more than
        that, for a cache that is kept after its call)."""
        if capacity <= self.capacity:
            return
        new_capacity = capacity if exact else max(capacity, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = _empty(old.shape[:3] + (new_capacity,) + old.shape[4:], old.dtype, old.device)
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
        if self.recurrent is not None and keep:
            self._replay(row, list(keep))
        if list(keep) != list(range(len(keep))):
            src = torch.as_tensor(keep, dtype=torch.long, device=self.keys.device) + base
            dst = torch.arange(base, base + len(keep), device=self.keys.device)
            # Advanced indexing on the right-hand side copies before the write, so overlapping slots are safe.
            self.keys[:, row, :, dst] = self.keys[:, row, :, src]
            self.values[:, row, :, dst] = self.values[:, row, :, src]
            if self.ring is not None:
                src, dst = src % self.ring_size, dst % self.ring_size
                self.ring_keys[:, row, :, dst] = self.ring_keys[:, row, :, src]
                self.ring_values[:, row, :, dst] = self.ring_values[:, row, :, src]
        self.lengths[row] = base + len(keep)

    @torch.inference_mode()
    def _replay(self, row: int, keep: list[int]) -> None:
        """The linear-attention state of `row` after the step nodes `keep` (a root-to-node path), all layers at once."""
        p = self.pending
        if p is None or max(keep) >= p.keys.shape[2]:
            raise ValueError(f"no pass computed nodes {keep} of row {row}")
        if keep == list(range(p.keys.shape[2])) and all(end is not None for end in p.chain_ends):
            for layer, end in enumerate(p.chain_ends):
                self.state[layer, row] = end[row]
        else:
            state = self.state[:, row]  # in place: [layers, heads, key_dim, value_dim]
            for node in keep:
                delta_step(state, p.keys[:, row, node], p.values[:, row, node], p.decays[:, row, node],
                           p.betas[:, row, node], state)
        width = self.recurrent.conv_width
        self.conv[:, row] = torch.cat([self.conv[:, row], p.inputs[:, row, keep].transpose(1, 2)], dim=-1)[..., -width:]

    def truncate(self, row: int, length: int) -> None:
        """Drop a row's tokens beyond `length` (e.g. to re-run a prompt suffix; not in a recurrent cache, and in a
        ring only as far back as it holds the window)."""
        if not 0 <= length <= self.lengths[row] or (self.recurrent is not None and length != self.lengths[row]) \
                or not self._ring_holds(row, length):
            why = (" (a recurrent state cannot go back)" if self.recurrent is not None and length != self.lengths[row]
                   else " (its sliding-window ring no longer holds that window)" if 0 <= length <= self.lengths[row]
                   else "")
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}{why}")
        self.lengths[row] = length

    @torch.inference_mode()
    def copy_prefix(self, row: int, source: "KVCache", source_row: int, length: int, start: int = 0) -> None:
        """Make this row the first `length` tokens of `source`'s row `source_row` (a prefix cache hit); with `start`,
        the row's first `start` tokens are those already and only the rest is copied."""
        if length > min(source.lengths[source_row], self.capacity) or not 0 <= start <= min(length, self.lengths[row]) \
                or not source._ring_holds(source_row, length):
            raise ValueError(f"cannot copy tokens {start}..{length}: the source row holds "
                             f"{source.lengths[source_row]}, this row {self.lengths[row]} of {self.capacity}")
        if self.recurrent is not None:  # the state exists at the source's length only
            if length != source.lengths[source_row]:
                raise ValueError(f"a recurrent state holds {source.lengths[source_row]} tokens, not {length}")
            self.conv[:, row] = source.conv[:, source_row]
            self.state[:, row] = source.state[:, source_row]
        self.keys[:, row, :, start:length] = source.keys[:, source_row, :, start:length]
        self.values[:, row, :, start:length] = source.values[:, source_row, :, start:length]
        if self.ring is not None:  # the window before `length`, from slots of the source's ring size to this one's
            window = torch.arange(max(0, length - self.ring.window + 1), length, device=self.keys.device)
            self.ring_keys[:, row, :, window % self.ring_size] = \
                source.ring_keys[:, source_row, :, window % source.ring_size]
            self.ring_values[:, row, :, window % self.ring_size] = \
                source.ring_values[:, source_row, :, window % source.ring_size]
            self.ring_from[row] = int(window[0]) if len(window) else 0
        self.lengths[row] = length

    def usable_prefix(self, row: int, length: int) -> int:
        """How much of a `length`-token prefix match on `row` a copy can use: all of it; with a recurrent state only
        the row's whole length, with a ring only as far back as it holds the window (0 otherwise)."""
        if self.recurrent is not None and length != self.lengths[row]:
            return 0
        return length if self._ring_holds(row, length) else 0

    @torch.inference_mode()
    def row(self, row: int) -> "KVCache":
        """A one-row cache with a copy of this row's tokens, sized to them."""
        length = self.lengths[row]
        shape = self.keys.shape
        copy = KVCache(shape[0], 1, shape[2], shape[4], max(length, 1), self.keys.dtype, self.keys.device,
                       self.recurrent, self.ring)
        copy.reserve_inputs(self.ring_size - self.ring.window + 1 if self.ring is not None else 0)
        copy.copy_prefix(0, self, row, length)
        return copy

    @torch.inference_mode()
    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order (sequences that finished leave the batch)."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.keys.device)
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        if self.recurrent is not None:
            self.conv, self.state = self.conv.index_select(1, index), self.state.index_select(1, index)
            self.pending = None
        if self.ring is not None:
            self.ring_keys = self.ring_keys.index_select(1, index)
            self.ring_values = self.ring_values.index_select(1, index)
        self.lengths = [self.lengths[r] for r in rows]
        self.ring_from = [self.ring_from[r] for r in rows]


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
