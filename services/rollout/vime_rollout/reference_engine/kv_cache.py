"""A slot-per-sequence KV cache that plugs into a Hugging Face decoder as its ``cache``.

Row ``i`` of every layer's K/V tensor belongs to the i-th running sequence, so a decode step over
the running batch reads a plain view ``k[:B, :, :L]`` (no gather). Finished sequences are removed
by moving the last row into the hole (`move_row`). Capacity grows by doubling on demand (slots up
to the batch limit, positions up to ``max_model_len``) and is dropped whole by `free` — that is
the memory a sleep gives back.

Per forward pass, `bind` says which rows are computed and at which positions the new tokens go;
the decoder's attention layers then call `update`, which writes the new keys/values in place and
returns the rows' cache up to the longest position. Causality and per-row lengths are enforced by
the attention mask built in `ModelRunner` (key ``j`` is visible to a query at position ``p`` iff
``j <= p``), so padding never leaks into a real token's attention.
"""

from __future__ import annotations

import torch

SLOT_FLOOR = 4
LENGTH_FLOOR = 16


def _grow(current: int, needed: int, limit: int, floor: int) -> int:
    size = max(current, min(floor, limit))
    while size < needed:
        size *= 2
    return min(max(size, needed), max(limit, needed))


class SlotKVCache:
    """Per-layer K/V tensors of shape ``[slots, kv_heads, capacity, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        max_slots: int,
        max_len: int,
    ) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.max_slots = max_slots
        self.max_len = max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows = slice(0, 0)
        self._row_index = torch.zeros(0, dtype=torch.long)
        self._positions = torch.zeros(0, 0, dtype=torch.long)
        self._kv_len = 0

    @property
    def slots(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def bytes_per_position(self) -> int:
        """Bytes one token position of one slot takes across all layers (keys and values)."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.kv_heads * self.head_dim * element

    def projected_nbytes(self, slots: int, length: int) -> int:
        """What the cache would hold after ``ensure(slots, length)``."""
        new_slots = _grow(self.slots, slots, self.max_slots, SLOT_FLOOR)
        new_len = _grow(self.capacity, length, self.max_len, LENGTH_FLOOR)
        return new_slots * new_len * self.bytes_per_position

    def ensure(self, slots: int, length: int) -> None:
        """Grow (never shrink) so that ``slots`` rows of ``length`` positions fit."""
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = _grow(self.slots, slots, self.max_slots, SLOT_FLOOR)
        new_len = _grow(self.capacity, length, self.max_len, LENGTH_FLOOR)
        shape = (new_slots, self.kv_heads, new_len, self.head_dim)
        old_slots, old_len = self.slots, self.capacity
        for store in (self.keys, self.values):
            for layer in range(self.num_layers):
                fresh = torch.zeros(shape, dtype=self.dtype)
                if layer < len(store):
                    fresh[:old_slots, :, :old_len] = store[layer]
                    store[layer] = fresh
                else:
                    store.append(fresh)

    def free(self) -> None:
        """Drop every tensor (sleep); the next `ensure` allocates afresh."""
        self.keys.clear()
        self.values.clear()

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` to row ``dst`` (compaction)."""
        if src == dst or not self.keys:
            return
        for store in (self.keys, self.values):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]

    def bind(self, row_start: int, positions: torch.Tensor, kv_len: int) -> None:
        """Set the rows ``[row_start, row_start + B)`` and token positions ``[B, T]`` of the next pass."""
        batch = int(positions.shape[0])
        self._rows = slice(row_start, row_start + batch)
        self._row_index = torch.arange(row_start, row_start + batch).unsqueeze(1)
        self._positions = positions
        self._kv_len = kv_len

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new ``[B, H, T, D]`` keys/values at their positions; return the rows' cache."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[self._row_index, :, self._positions] = key_states.transpose(1, 2).to(self.dtype)
        v[self._row_index, :, self._positions] = value_states.transpose(1, 2).to(self.dtype)
        return k[self._rows, :, : self._kv_len], v[self._rows, :, : self._kv_len]
