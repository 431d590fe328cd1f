"""Rank 0's KV slot allocator: the one free list over the slot index space
that every rank's KV pool shares (DESIGN §1, §4)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

# Per-slot states. Slot 0 has its own so that freeing it names the real mistake.
_FREE, _STAGED, _ALLOCATED, _PADDING = 0, 1, 2, 3


class OutOfSlots(RuntimeError):
    """An allocation asked for more slots than are available."""

    def __init__(self, asked: int, available: int) -> None:
        super().__init__(
            f"asked for {asked} KV slots but only {available} are available; "
            "evict cached prefixes or retract requests first"
        )
        self.asked = asked
        self.available = available


class SlotAllocator:
    """Slots 1..capacity-1 (slot 0 is the pool's padding slot and never handed out).

    Invariant: every usable slot is in exactly one state: free, staged (freed
    inside an open free group) or allocated. `available` counts free and staged
    alike, so a slot freed is available at once. `alloc` hands out the
    lowest-numbered free slots, reaching for staged ones only when the free
    ones run short, so its result never depends on the order slots were freed
    in; that keeps the scheduler replayable from its logs.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(f"slot capacity {capacity} leaves no usable slot (slot 0 is padding)")
        self.capacity = capacity
        self._state = bytearray(capacity)
        self._state[0] = _PADDING
        self._free = list(range(1, capacity))  # a heap; ascending is already one
        self._staged: list[int] = []
        self._group_depth = 0

    @property
    def available(self) -> int:
        """Free slots, including any staged in an open free group."""
        return len(self._free) + len(self._staged)

    @property
    def used(self) -> int:
        """Allocated slots."""
        return self.capacity - 1 - self.available

    def alloc(self, n: int) -> list[int]:
        """n slots, lowest-numbered first; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.available:
            raise OutOfSlots(n, self.available)
        if n > len(self._free):
            self._merge_staged()
        slots = [heapq.heappop(self._free) for _ in range(n)]
        for slot in slots:
            self._state[slot] = _ALLOCATED
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Return allocated slots; all or nothing, so a bad slot changes no state."""
        slots = list(slots)
        self._check_allocated(slots)
        if self._group_depth:
            for slot in slots:
                self._state[slot] = _STAGED
            self._staged.extend(slots)
            return
        for slot in slots:
            self._state[slot] = _FREE
            heapq.heappush(self._free, slot)

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Stage the frees made inside (one pass's worth) and merge them at exit.

        Staged slots are counted in `available` and can be allocated at once;
        groups nest and merge at the outermost exit, even when it raises, so a
        free once made is never lost."""
        self._group_depth += 1
        try:
            yield
        finally:
            self._group_depth -= 1
            if self._group_depth == 0:
                self._merge_staged()

    def _merge_staged(self) -> None:
        for slot in self._staged:
            self._state[slot] = _FREE
            heapq.heappush(self._free, slot)
        self._staged.clear()

    def _check_allocated(self, slots: list[int]) -> None:
        seen: set[int] = set()
        for slot in slots:
            if not 0 <= slot < self.capacity:
                raise ValueError(f"slot {slot} is outside 1..{self.capacity - 1}")
            if self._state[slot] == _PADDING:
                raise ValueError("slot 0 is the padding slot and is never allocated")
            if self._state[slot] != _ALLOCATED or slot in seen:
                raise ValueError(f"slot {slot} is not allocated (freed twice?)")
            seen.add(slot)
