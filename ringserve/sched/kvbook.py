"""Where each request's KV lives, on rank 0: slots drawn from the allocator,
prefixes borrowed from and handed to the radix cache. Mechanism only; which
request gets slots is the scheduler's policy. Pure Python over ints."""

from __future__ import annotations

from ringserve.cache.allocator import OutOfSlots, SlotAllocator
from ringserve.cache.radix import RadixCache, RadixNode, TierMatch
from ringserve.sched.request import Request

# When slots run short, evict at least capacity / EVICT_FRACTION at once:
# each eviction walks the tree, and a pass of decodes would otherwise ask
# for one slot at a time.
EVICT_FRACTION = 64


class KVBook:
    """Invariant: every slot in a request's `private` set is that request's
    alone and is freed when it leaves; every other slot of its row belongs to
    the radix cache and is locked through `req.node`."""

    def __init__(self, allocator: SlotAllocator, cache: RadixCache, prefix_reuse: bool) -> None:
        self.allocator = allocator
        self.cache = cache
        self.prefix_reuse = prefix_reuse

    @property
    def available(self) -> int:
        return self.allocator.available

    @property
    def keeps_retracted(self) -> bool:
        """Whether a retracted request's KV stays cached (to spill to the
        host tier under pressure) instead of being freed."""
        return self.prefix_reuse and self.cache.host_capacity > 0

    def shares(self, req: Request) -> bool:
        """Whether the request reuses cached prefixes and hands its KV to the
        cache while it runs: not one that asks for prompt logprobs, which
        must compute every prompt position. Such a request's KV duplicates
        what the cache may hold of its prompt; handed over while it runs, it
        would lock the cache's copy beside its own, and a pool that holds one
        copy but not two could never finish it. It hands its KV over once it
        ends."""
        return self.prefix_reuse and req.params.prompt_logprobs is None

    def match(self, req: Request) -> TierMatch:
        """Longest prefix cached in either tier, leaving at least one token
        to compute; none for a request that does not share (`shares`)."""
        probe = req.tokens[:-1] if self.shares(req) else []
        return self.cache.match_tiers(probe)

    def evict_for(self, n: int) -> None:
        """Evict unlocked cache, in a batch, when fewer than n slots are free."""
        short = n - self.allocator.available
        if short > 0:
            self.cache.evict(max(short, self.allocator.capacity // EVICT_FRACTION))

    def take(self, n: int) -> list[int] | None:
        """n slots, or None when they are not free (the caller parks)."""
        try:
            return self.allocator.alloc(n)
        except OutOfSlots:
            return None

    def borrow(self, req: Request, node: RadixNode) -> None:
        """Lock the cached prefix ending at `node` for the request."""
        self.cache.lock(node)
        req.node = node

    def give_back(self, req: Request) -> None:
        """Unlock the prefix the request borrowed and never used."""
        self.cache.unlock(req.node)
        req.node = None

    def roll_back(self, req: Request, start: int, slots: list[int]) -> None:
        """Undo a voided pass's extension of the request's row: cut the row
        back to `start` and free the `slots` the pass took."""
        del req.row[start:]
        self.allocator.free(slots)
        req.private.difference_update(slots)

    def insert(self, req: Request) -> None:
        """Hand the request's confirmed KV to the radix cache and lock it."""
        dups = self.cache.insert(req.tokens[: len(req.row)], req.row)
        req.private = set(dups)
        found = self.cache.match_prefix(req.tokens[: len(req.row)])
        self.cache.lock(found.node)
        self.cache.unlock(req.node)
        req.node = found.node

    def release(self, req: Request) -> None:
        """Free what the request owns and unlock what it borrowed."""
        self.allocator.free(sorted(req.private))
        self.cache.unlock(req.node)
        req.private, req.row, req.node = set(), [], None
