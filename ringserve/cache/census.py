"""The KV census: where every usable slot is, counted from the objects that
hold them (DESIGN §4). It must balance after every pass."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.radix import RadixCache
from ringserve.cache.tiers import TieredCache


class CensusError(RuntimeError):
    """The slot census does not add up: some slot is lost or counted twice."""


@dataclass(frozen=True)
class Census:
    """One reading of the slot ledger. Balanced means every usable slot
    (slot 0 is padding) is free, cached or held privately by a running
    request, and none is two of those; and, with a host tier, every usable
    host slot is free, cached where it may be evicted, or pinned (a locked
    node's, or a copy's in transit), and none is two of those."""

    capacity: int
    free: int
    cached_unlocked: int
    cached_locked: int
    held_by_running: int
    host_capacity: int = 0  # counts its padding slot 0 too; 0: no host tier
    host_free: int = 0
    host_unlocked: int = 0
    host_pinned: int = 0

    @property
    def accounted(self) -> int:
        return self.free + self.cached_unlocked + self.cached_locked + self.held_by_running

    @property
    def host_accounted(self) -> int:
        return self.host_free + self.host_unlocked + self.host_pinned

    @property
    def balanced(self) -> bool:
        host_usable = max(self.host_capacity - 1, 0)
        return self.accounted == self.capacity - 1 and self.host_accounted == host_usable


def take_census(allocator: SlotAllocator, cache: RadixCache, held_by_running: int) -> Census:
    """Read the ledger; held_by_running is the slots running requests own privately."""
    census = Census(
        capacity=allocator.capacity,
        free=allocator.available,
        cached_unlocked=cache.evictable_size,
        cached_locked=cache.locked_size,
        held_by_running=held_by_running,
    )
    if not isinstance(cache, TieredCache):
        return census
    return replace(
        census,
        host_capacity=cache.host.capacity,
        host_free=cache.host.available,
        host_unlocked=cache.host_evictable,
        host_pinned=cache.host_pinned,
    )


def check_census(census: Census) -> None:
    """Raise CensusError, showing every figure, unless the census balances."""
    if census.balanced:
        return
    host_usable = max(census.host_capacity - 1, 0)
    if census.accounted == census.capacity - 1:
        gap = host_usable - census.host_accounted
        what = f"{gap} slots are missing" if gap > 0 else f"{-gap} slots are counted twice"
        raise CensusError(
            f"host KV slot census does not balance: free {census.host_free} + unlocked "
            f"{census.host_unlocked} + pinned {census.host_pinned} = {census.host_accounted}, "
            f"but the host tier has {host_usable} usable slots: {what}"
        )
    usable = census.capacity - 1
    gap = usable - census.accounted
    what = f"{gap} slots are missing" if gap > 0 else f"{-gap} slots are counted twice"
    raise CensusError(
        f"KV slot census does not balance: free {census.free} + cached_unlocked "
        f"{census.cached_unlocked} + cached_locked {census.cached_locked} + held_by_running "
        f"{census.held_by_running} = {census.accounted}, but capacity {census.capacity} has "
        f"{usable} usable slots (slot 0 is padding): {what}"
    )
