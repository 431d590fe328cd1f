"""The host tier of one rank's KV: K and V rows of the rank's layers in host
memory, over the host slot space that rank 0's tiered cache hands out (the
same on every rank, as the device slots are). Rank 0 decides every copy;
this only performs a pass's copies (DESIGN §3.9)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringserve.cache.pool import KVPool
from ringserve.ring.messages import TierCopy


class HostPool:
    """Per-layer K and V tensors [capacity, num_kv_heads, head_dim] in host
    memory; slot 0 is padding, never handed out.

    `spill` then `load` run before a pass's forward. On the CPU both are
    plain index copies. On CUDA the rows are pinned and the copies run on a
    side stream that first waits for the work already queued: a spill has
    landed in the host rows when `spill` returns (the device rows it reads
    may be overwritten by this very pass), and a load is ordered before the
    pass's forward by an event that only the compute stream waits for."""

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
            raise ValueError(f"host KV pool capacity {capacity} leaves no usable slot")
        self.device = torch.device(device)
        self.capacity = capacity
        cuda = self.device.type == "cuda"
        shape = (capacity, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, pin_memory=cuda) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, pin_memory=cuda) for _ in range(num_layers)]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._loading: list[torch.Tensor] = []  # pinned sources of the last loads
        self._loaded: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def spill(self, pool: KVPool, copies: Sequence[TierCopy]) -> int:
        """Copy device rows to host rows; returns the tokens copied."""
        src, dst = _flat(copies, pool.capacity, self.capacity)
        if not src:
            return 0
        pairs = list(zip(pool.k + pool.v, self.k + self.v, strict=True))
        to = torch.tensor(dst)
        if self.stream is None:
            at = torch.tensor(src)
            for rows, host in pairs:
                host.index_copy_(0, to, rows.index_select(0, at))
            return len(src)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            at = torch.tensor(src, device=self.device)
            staged = []
            for rows, _ in pairs:
                picked = rows.index_select(0, at)
                buf = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
                staged.append(buf.copy_(picked, non_blocking=True))
        self.stream.synchronize()
        for buf, (_, host) in zip(staged, pairs, strict=True):
            host.index_copy_(0, to, buf)
        return len(src)

    def load(self, pool: KVPool, copies: Sequence[TierCopy]) -> int:
        """Copy host rows to device rows; returns the tokens copied."""
        src, dst = _flat(copies, self.capacity, pool.capacity)
        if not src:
            return 0
        pairs = list(zip(self.k + self.v, pool.k + pool.v, strict=True))
        at = torch.tensor(src)
        if self.stream is None:
            to = torch.tensor(dst)
            for host, rows in pairs:
                rows.index_copy_(0, to, host.index_select(0, at))
            return len(src)
        if self._loaded is not None:
            self._loaded.synchronize()  # the last loads' pinned sources may go now
        self._loading = [host.index_select(0, at).pin_memory() for host, _ in pairs]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            to = torch.tensor(dst, device=self.device)
            for buf, (_, rows) in zip(self._loading, pairs, strict=True):
                rows.index_copy_(0, to, buf.to(self.device, non_blocking=True))
            self._loaded = torch.cuda.Event()
            self._loaded.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(self._loaded)
        return len(src)


def _flat(copies: Sequence[TierCopy], src_capacity: int, dst_capacity: int) -> tuple[list, list]:
    """The copies' slots as two flat lists, checked: in range, lengths
    equal, and no destination written twice (index copies would race)."""
    src = [s for c in copies for s in c.src]
    dst = [d for c in copies for d in c.dst]
    if len(src) != len(dst):
        raise ValueError(f"a KV copy of {len(src)} slots into {len(dst)}")
    if src and not (0 < min(src) and max(src) < src_capacity):
        raise ValueError(f"KV copy source slots outside 1..{src_capacity - 1}")
    if dst and not (0 < min(dst) and max(dst) < dst_capacity):
        raise ValueError(f"KV copy target slots outside 1..{dst_capacity - 1}")
    if len(set(dst)) != len(dst):
        raise ValueError("a KV copy writes one slot twice")
    return src, dst
