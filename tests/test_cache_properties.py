"""The slot census under random request traffic: a real SlotAllocator and
RadixCache driven the way the scheduler drives them, checked after every step."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.census import Census, CensusError, check_census, take_census
from ringserve.cache.radix import RadixCache, RadixNode

# A three-letter alphabet and short prompts, so prefixes collide often.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=8)
EVICT_ASKS = st.integers(0, 10) | st.just(math.inf)


def test_census_balances_when_every_usable_slot_is_counted_once():
    assert Census(10, free=3, cached_unlocked=2, cached_locked=1, held_by_running=3).balanced


def test_census_error_shows_every_figure():
    census = Census(10, free=3, cached_unlocked=2, cached_locked=1, held_by_running=1)
    assert not census.balanced
    with pytest.raises(CensusError) as err:
        check_census(census)
    for figure in ("free 3", "cached_unlocked 2", "cached_locked 1", "held_by_running 1"):
        assert figure in str(err.value)
    assert "= 7" in str(err.value) and "9 usable" in str(err.value)
    assert "2 slots are missing" in str(err.value)


def test_take_census_reads_the_allocator_and_the_cache():
    alloc = SlotAllocator(8)
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3], alloc.alloc(3))
    cache.lock(cache.match_prefix([1]).node)
    private = alloc.alloc(2)
    census = take_census(alloc, cache, held_by_running=len(private))
    assert census == Census(8, free=2, cached_unlocked=2, cached_locked=1, held_by_running=2)
    check_census(census)


@dataclass
class Running:
    """A simulated request: `slots` is its KV row; `private` those it owns,
    the rest borrowed from the tree through the lock on `node`."""

    tokens: list[int]
    slots: list[int]
    private: list[int]
    node: RadixNode


def tree_nodes(cache: RadixCache) -> list[RadixNode]:
    stack, out = [cache._root], []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out[1:]


class CacheTraffic(RuleBasedStateMachine):
    @initialize(capacity=st.integers(4, 40))
    def start(self, capacity: int) -> None:
        self.alloc = SlotAllocator(capacity)
        self.cache = RadixCache(self.alloc)
        self.running: list[Running] = []

    # ---- helpers the rules share ---------------------------------------------

    def evict_checked(self, ask: float) -> int:
        """Evict and check the receipt against both books it moves."""
        evictable, available = self.cache.evictable_size, self.alloc.available
        freed = self.cache.evict(ask)
        assert freed == evictable - self.cache.evictable_size
        assert freed == self.alloc.available - available
        assert min(ask, evictable) <= freed <= evictable
        return freed

    def reserve(self, n: int) -> list[int] | None:
        """n private slots, evicting the shortfall first; None when even that is short."""
        if n > self.alloc.available:
            self.evict_checked(n - self.alloc.available)
        if n > self.alloc.available:
            return None
        return self.alloc.alloc(n)

    def pick(self, data: st.DataObject) -> Running:
        return self.running[data.draw(st.integers(0, len(self.running) - 1))]

    def admit(self, tokens: list[int]) -> None:
        hit = self.cache.match_prefix(tokens)
        assert len(hit.slots) <= len(tokens)
        self.cache.lock(hit.node)
        private = self.reserve(len(tokens) - len(hit.slots))
        if private is None:
            self.cache.unlock(hit.node)  # parked: nothing taken
            return
        self.running.append(Running(tokens, hit.slots + private, private, hit.node))

    def insert(self, req: Running, upto: int) -> list[int]:
        duplicates = self.cache.insert(req.tokens[:upto], req.slots[:upto])
        assert set(duplicates) <= set(req.private)
        return duplicates

    def finish(self, req: Running, upto: int) -> None:
        """Cache tokens[:upto], free the duplicates and the uncached private tail."""
        duplicates = self.insert(req, upto)
        private = set(req.private)
        tail = [slot for slot in req.slots[upto:] if slot in private]
        self.alloc.free(duplicates + tail)
        self.cache.unlock(req.node)
        self.running.remove(req)

    # ---- rules -----------------------------------------------------------------

    @rule(tokens=TOKENS)
    def arrive(self, tokens: list[int]) -> None:
        self.admit(tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = self.pick(data)
        slot = self.reserve(1)
        if slot is not None:
            req.tokens.append(token)
            req.slots += slot
            req.private += slot

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_running(self, data: st.DataObject) -> None:
        """Mid-life insert: the tree adopts the row, the request relocks deeper."""
        req = self.pick(data)
        duplicates = self.insert(req, len(req.tokens))
        self.alloc.free(duplicates)
        hit = self.cache.match_prefix(req.tokens)
        assert len(hit.slots) == len(req.tokens)
        assert all(a == b or a in duplicates for a, b in zip(req.slots, hit.slots, strict=True))
        self.cache.lock(hit.node)
        self.cache.unlock(req.node)
        req.slots, req.private, req.node = hit.slots, [], hit.node

    @precondition(lambda self: self.running)
    @rule(data=st.data(), grouped=st.booleans())
    def leave(self, data: st.DataObject, grouped: bool) -> None:
        req = self.pick(data)
        upto = data.draw(st.integers(0, len(req.tokens)))
        if not grouped:
            self.finish(req, upto)
            return
        with self.alloc.free_group():
            self.finish(req, upto)
            self.check_census()  # staged frees must already count as free

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tokens=TOKENS)
    def leave_and_arrive_in_one_pass(self, data: st.DataObject, tokens: list[int]) -> None:
        """A newcomer may be paid with slots still staged in the pass's free group."""
        req = self.pick(data)
        with self.alloc.free_group():
            self.finish(req, len(req.tokens))
            self.admit(tokens)
            self.check_census()

    @rule(ask=EVICT_ASKS)
    def evict(self, ask: float) -> None:
        self.evict_checked(ask)

    @precondition(lambda self: not self.running and self.cache.total_size)
    @rule()
    def reset(self) -> None:
        total, available = self.cache.total_size, self.alloc.available
        assert self.cache.reset() == total
        assert self.alloc.available == available + total
        assert self.cache.total_size == 0

    # ---- invariants, checked after every step -----------------------------------

    @invariant()
    def check_census(self) -> None:
        held = sum(len(req.private) for req in self.running)
        check_census(take_census(self.alloc, self.cache, held))

    @invariant()
    def sizes_match_the_tree(self) -> None:
        nodes = tree_nodes(self.cache)
        assert self.cache.evictable_size == sum(len(n.value) for n in nodes if n.lock_ref == 0)
        assert self.cache.locked_size == sum(len(n.value) for n in nodes if n.lock_ref > 0)
        for node in nodes:
            assert node.parent is self.cache._root or node.lock_ref <= node.parent.lock_ref

    @invariant()
    def lock_refs_count_the_running_requests(self) -> None:
        expected: dict[int, int] = {}
        for req in self.running:
            node = req.node
            while node is not self.cache._root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in tree_nodes(self.cache):
            assert node.lock_ref == expected.get(id(node), 0)

    @invariant()
    def every_slot_has_one_owner(self) -> None:
        cached = [slot for node in tree_nodes(self.cache) for slot in node.value]
        private = [slot for req in self.running for slot in req.private]
        owned = cached + private
        assert len(owned) == len(set(owned)) and 0 not in owned
        for req in self.running:
            assert len(req.slots) == len(req.tokens)

    @invariant()
    def evicting_everything_pays_evictable_size(self) -> None:
        alloc, cache = copy.deepcopy((self.alloc, self.cache))
        assert cache.evict(math.inf) == self.cache.evictable_size
        assert cache.evictable_size == 0
        assert alloc.available == self.alloc.available + self.cache.evictable_size


CacheTraffic.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, database=None
)
TestCacheTraffic = CacheTraffic.TestCase


def replay(script: list[tuple[list[int], int, float]]) -> tuple[list[object], RadixCache]:
    """Admit, evict and finish on fresh objects; record every result."""
    alloc = SlotAllocator(24)
    cache = RadixCache(alloc)
    trace: list[object] = []
    for tokens, upto, ask in script:
        hit = cache.match_prefix(tokens)
        cache.lock(hit.node)
        freed = cache.evict(ask)
        private = alloc.alloc(min(len(tokens) - len(hit.slots), alloc.available))
        slots = hit.slots + private
        dups = cache.insert(tokens[: min(upto, len(slots))], slots[: min(upto, len(slots))])
        alloc.free(dups + private[max(upto - len(hit.slots), 0) :])
        cache.unlock(hit.node)
        trace.append((hit.slots, freed, private, dups))
    return trace, cache


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(TOKENS, st.integers(0, 8), EVICT_ASKS), max_size=25))
def test_same_operations_give_the_same_decisions(script):
    first, kept = replay(script)  # kept alive so the second run's nodes live elsewhere
    second, _ = replay(script)
    assert first == second
