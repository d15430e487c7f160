"""Per-session KV storage for batched verification: one contiguous slot per session.

A slot holds keys and values of every layer, ``[layers, 2, kv_heads, capacity, head_dim]``, and
a length. Positions ``[0, length)`` are valid; rolling back to a committed prefix is moving the
length (no copy), appending writes rows at ``length``. Capacity grows by doubling (amortised
O(1) per token), so a session costs memory in proportion to its own context, and the store can
say exactly how many bytes it holds (admission by memory, metrics).

Contiguous per-session slots, rather than a shared page pool, because on CPU attention reads
each session's keys once per layer: a slice of a slot is a view, a page table would be a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.cloud.kv_growth import MIN_SLOT, slot_positions


@dataclass
class Slot:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]


class KVSlots:
    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ):
        self.shape = (layers, 2, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.slots: dict[int, Slot] = {}
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = layers * 2 * kv_heads * head_dim * itemsize

    def _alloc(self, capacity: int) -> torch.Tensor:
        layers, two, heads, dim = self.shape
        return torch.empty(
            (layers, two, heads, capacity, dim), dtype=self.dtype, device=self.device
        )

    def open(self, sid: int) -> Slot:
        """A fresh, empty slot for ``sid`` (replacing any slot it had)."""
        slot = Slot(self._alloc(MIN_SLOT))
        self.slots[sid] = slot
        return slot

    def reserve(self, slot: Slot, length: int) -> None:
        """Makes room for ``length`` positions, keeping what the slot holds."""
        if length <= slot.capacity:
            return
        grown = self._alloc(slot_positions(length))
        grown[:, :, :, : slot.length] = slot.kv[:, :, :, : slot.length]
        slot.kv = grown

    def growth_bytes(self, slot: Slot | None, length: int) -> int:
        """Bytes the store holds more once ``slot`` (None: a fresh one) holds ``length``
        positions (the old slot's memory is freed after the copy)."""
        old = slot.capacity if slot is not None else 0
        if length <= old:
            return 0
        return (slot_positions(length) - old) * self.bytes_per_token

    def free(self, sid: int) -> bool:
        return self.slots.pop(sid, None) is not None

    @property
    def bytes_held(self) -> int:
        return sum(s.kv.numel() * s.kv.element_size() for s in self.slots.values())
