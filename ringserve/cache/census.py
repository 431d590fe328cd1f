"""The KV census: where every usable slot is, counted from the objects that
hold them (DESIGN §4). It must balance after every pass."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.radix import RadixCache


class CensusError(RuntimeError):
    """The slot census does not add up: some slot is lost or counted twice."""


@dataclass(frozen=True)
class Census:
    """One reading of the slot ledger. Balanced means every usable slot
    (slot 0 is padding) is free, cached or held privately by a running
    request, and none is two of those."""

    capacity: int
    free: int
    cached_unlocked: int
    cached_locked: int
    held_by_running: int

    @property
    def accounted(self) -> int:
        return self.free + self.cached_unlocked + self.cached_locked + self.held_by_running

    @property
    def balanced(self) -> bool:
        return self.accounted == self.capacity - 1


def take_census(allocator: SlotAllocator, cache: RadixCache, held_by_running: int) -> Census:
    """Read the ledger; held_by_running is the slots running requests own privately."""
    return Census(
        capacity=allocator.capacity,
        free=allocator.available,
        cached_unlocked=cache.evictable_size,
        cached_locked=cache.locked_size,
        held_by_running=held_by_running,
    )


def check_census(census: Census) -> None:
    """Raise CensusError, showing every figure, unless the census balances."""
    if census.balanced:
        return
    usable = census.capacity - 1
    gap = usable - census.accounted
    what = f"{gap} slots are missing" if gap > 0 else f"{-gap} slots are counted twice"
    raise CensusError(
        f"KV slot census does not balance: free {census.free} + cached_unlocked "
        f"{census.cached_unlocked} + cached_locked {census.cached_locked} + held_by_running "
        f"{census.held_by_running} = {census.accounted}, but capacity {census.capacity} has "
        f"{usable} usable slots (slot 0 is padding): {what}"
    )
