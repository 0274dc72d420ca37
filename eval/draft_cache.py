"""A preallocated one-layer KV cache for drafting: appends write in place, rollback is O(1).

Why: EAGLE/EAGLE-3 drafts append a few committed entries and up to ``depth`` batches of tree entries
per step, then drop the tree entries again. A transformers ``DynamicCache`` re-allocates (``cat``)
the whole [1, nkv, T, d] tensors on every append and the rollback re-gathers them with
``index_select``: O(T) copies several times per step. Here the storage only grows (doubling) and a
rollback just moves the length back; the attention reads views of the filled part.

It implements the one method the family's attention module calls (``update``), so the draft's own
layer code (the same as training's) runs unchanged on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _LayerView:
    """What tests and tools read from a transformers cache layer: the filled keys/values [1, nkv, T, d]."""

    keys: torch.Tensor
    values: torch.Tensor


class DraftKVCache:
    """Single-layer K/V storage [B, nkv, capacity, d] with a fill length (``length`` = entries held)."""

    def __init__(self, capacity: int = 512):
        self.capacity = int(capacity)
        self.length = 0
        self.k: torch.Tensor | None = None  # [B, nkv, capacity, d]
        self.v: torch.Tensor | None = None

    def _grow(self, like: torch.Tensor, need: int) -> None:
        """(Re)allocate with room for ``need`` entries (doubling), keeping the filled part."""
        cap = self.capacity if self.k is None else 2 * self.k.shape[-2]
        while cap < need:
            cap *= 2
        B, nkv, _, d = like.shape
        k, v = like.new_empty(B, nkv, cap, d), like.new_empty(B, nkv, cap, d)
        if self.k is not None and self.v is not None and self.length:
            k[..., : self.length, :] = self.k[..., : self.length, :]
            v[..., : self.length, :] = self.v[..., : self.length, :]
        self.k, self.v, self.capacity = k, v, cap

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int = 0, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [B, nkv, S, d] keys/values; return all filled keys/values (views)."""
        end = self.length + key_states.shape[-2]
        if self.k is None or end > self.k.shape[-2] or self.k.dtype != key_states.dtype:
            self._grow(key_states, end)
        assert self.k is not None and self.v is not None
        self.k[..., self.length: end, :] = key_states
        self.v[..., self.length: end, :] = value_states
        self.length = end
        return self.k[..., :end, :], self.v[..., :end, :]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries (the rest is overwritten by later appends)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft cache of {self.length} entries to {length}")
        self.length = int(length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def layers(self) -> list[_LayerView]:
        """transformers-cache-like view of the filled part (tests compare it with a fresh prefill)."""
        if self.k is None:
            return []
        return [_LayerView(self.k[..., : self.length, :], self.v[..., : self.length, :])]
