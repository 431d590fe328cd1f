"""The KV pool of one rank: K and V rows for every local layer over the same
token slot index space on every rank (DESIGN §1)."""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V tensors of shape [capacity, num_kv_heads, head_dim].

    Slot 0 is reserved as the padding slot: the allocator never hands it out,
    so padded gathers may read it freely. `capacity` counts slot 0."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity < 2:
            raise ValueError(f"KV pool capacity {capacity} leaves no usable slot")
        shape = (capacity, num_kv_heads, head_dim)
        self.capacity = capacity
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated, reported against the memory plan."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
