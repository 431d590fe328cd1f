from __future__ import annotations

import math

import pytest
from structlog.testing import capture_logs

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.radix import RadixCache


def make(capacity: int = 64) -> tuple[SlotAllocator, RadixCache]:
    alloc = SlotAllocator(capacity)
    return alloc, RadixCache(alloc)


def cache_tokens(alloc: SlotAllocator, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert tokens as a finished request would: fresh slots for the uncached tail."""
    hit = cache.match_prefix(tokens)
    slots = hit.slots + alloc.alloc(len(tokens) - len(hit.slots))
    assert cache.insert(tokens, slots) == []
    return slots


def test_match_on_an_empty_cache_is_the_root_with_no_slots():
    _, cache = make()
    hit = cache.match_prefix([1, 2, 3])
    assert hit.slots == []
    cache.lock(hit.node)  # the root: locking it pins nothing
    assert (cache.total_size, cache.locked_size) == (0, 0)
    cache.unlock(hit.node)


def test_match_returns_the_slots_of_the_longest_cached_prefix():
    alloc, cache = make()
    slots = cache_tokens(alloc, cache, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots == slots
    assert cache.match_prefix([1, 2, 9]).slots == slots[:2]
    assert cache.match_prefix([7]).slots == []
    assert cache.match_prefix([]).slots == []


def test_match_ending_inside_an_edge_splits_it_at_the_match():
    alloc, cache = make()
    slots = cache_tokens(alloc, cache, [1, 2, 3, 4])
    head = cache.match_prefix([1, 2, 7]).node
    cache.lock(head)
    assert cache.locked_size == 2  # the node covers exactly [1, 2]
    assert cache.evict(math.inf) == 2
    assert cache.match_prefix([1, 2, 3, 4]).slots == slots[:2]


def test_split_keeps_an_existing_handle_covering_the_same_prefix():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2, 3, 4])
    deep = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(deep)
    cache.match_prefix([1, 2])  # splits the locked edge
    assert (cache.locked_size, cache.evictable_size) == (4, 0)
    assert cache.evict(math.inf) == 0
    cache.unlock(deep)
    assert (cache.locked_size, cache.evictable_size) == (0, 4)


def test_insert_takes_uncached_positions_and_returns_duplicates():
    alloc, cache = make()
    first = cache_tokens(alloc, cache, [1, 2, 3])
    mine = alloc.alloc(5)
    duplicates = cache.insert([1, 2, 3, 4, 5], mine)
    assert duplicates == mine[:3]
    assert cache.total_size == 5
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == first + mine[3:]


def test_insert_neither_takes_nor_returns_borrowed_tree_slots():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2, 3])
    borrowed = cache.match_prefix([1, 2, 3]).slots
    tail = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 8, 9], borrowed + tail) == []
    assert cache.total_size == 5
    assert alloc.used == 5


def test_insert_into_the_middle_of_an_edge_splits_it():
    alloc, cache = make()
    first = cache_tokens(alloc, cache, [1, 2, 3, 4])
    other = alloc.alloc(2)
    assert cache.insert([1, 2, 8, 9], first[:2] + other) == []
    assert cache.match_prefix([1, 2, 3, 4]).slots == first
    assert cache.match_prefix([1, 2, 8, 9]).slots == first[:2] + other


def test_insert_with_mismatched_lengths_is_refused():
    _, cache = make()
    with pytest.raises(ValueError, match="3 tokens with 2 slots"):
        cache.insert([1, 2, 3], [1, 2])


def test_lock_pins_the_whole_path_and_unlock_releases_it():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2])
    cache_tokens(alloc, cache, [1, 2, 3, 4])
    cache_tokens(alloc, cache, [5, 6])
    deep = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(deep)
    cache.lock(deep)
    assert (cache.locked_size, cache.evictable_size, cache.total_size) == (4, 2, 6)
    cache.unlock(deep)
    assert cache.locked_size == 4  # one lock still held
    cache.unlock(deep)
    assert (cache.locked_size, cache.evictable_size) == (0, 6)


def test_locking_a_child_keeps_a_locked_parent_locked():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2, 3, 4])
    parent = cache.match_prefix([1, 2]).node
    child = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(parent)
    cache.lock(child)
    cache.unlock(child)
    assert (cache.locked_size, cache.evictable_size) == (2, 2)
    assert cache.evict(math.inf) == 2


def test_unlock_below_zero_raises_and_changes_nothing():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    assert (cache.locked_size, cache.evictable_size) == (0, 2)


def test_lock_of_an_evicted_node_is_refused():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.evict(math.inf)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(node)


def test_evict_frees_the_least_recently_used_leaf_first():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 1])
    cache_tokens(alloc, cache, [2, 2])
    cache_tokens(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # now [2, 2] is the oldest
    before = alloc.available
    assert cache.evict(2) == 2
    assert alloc.available == before + 2
    assert cache.match_prefix([2, 2]).slots == []
    assert len(cache.match_prefix([1, 1]).slots) == len(cache.match_prefix([3, 3]).slots) == 2


def test_parent_left_childless_joins_the_frontier_in_lru_order():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2, 3])
    cache_tokens(alloc, cache, [1, 2, 3, 4])  # [1,2,3] -> [4]
    cache_tokens(alloc, cache, [5])  # newer than both
    assert cache.evict(2) == 4  # leaf [4], then its parent [1,2,3] (older than [5]) whole
    assert cache.match_prefix([5]).slots != []
    assert cache.total_size == 1


def test_evict_receipt_is_what_it_freed_not_what_was_asked():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2, 3])
    assert cache.evict(100) == 3
    assert cache.evict(5) == 0
    assert cache.evict(0) == cache.evict(-3) == 0
    assert alloc.used == 0


def test_evict_never_touches_locked_nodes():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2])
    cache_tokens(alloc, cache, [3, 4])
    cache.lock(cache.match_prefix([1, 2]).node)
    cache.match_prefix([3, 4])  # the locked leaf is now the least recent
    assert cache.evict(math.inf) == 2
    assert cache.match_prefix([3, 4]).slots == []
    assert len(cache.match_prefix([1, 2]).slots) == 2


def test_evictable_size_is_what_evicting_everything_pays():
    alloc, cache = make()
    for tokens in ([1, 2, 3], [1, 2, 4, 5], [1, 6], [7, 8, 9]):
        cache_tokens(alloc, cache, tokens)
    cache.lock(cache.match_prefix([1, 2, 4]).node)
    evictable = cache.evictable_size
    assert cache.evict(math.inf) == evictable == 6
    assert cache.total_size == cache.locked_size == 3


def test_evict_logs_what_was_asked_and_what_was_freed():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2, 3])
    with capture_logs() as logs:
        cache.evict(2)
    assert [(e["event"], e["asked"], e["freed"]) for e in logs] == [("cache.evict", 2, 3)]


def test_evict_inside_a_free_group_is_available_at_once():
    alloc, cache = make(4)
    cache_tokens(alloc, cache, [1, 2, 3])
    with alloc.free_group():
        assert cache.evict(3) == 3
        assert alloc.alloc(3) == [1, 2, 3]


def test_reset_frees_every_slot_and_empties_the_tree():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2, 3])
    cache_tokens(alloc, cache, [1, 4])
    assert cache.reset() == 4
    assert (cache.total_size, alloc.used) == (0, 0)
    assert cache.match_prefix([1, 2, 3]).slots == []


def test_reset_refuses_while_a_node_is_locked():
    alloc, cache = make()
    cache_tokens(alloc, cache, [1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="2 slots are locked"):
        cache.reset()
    assert cache.total_size == 2
    cache.unlock(node)
    assert cache.reset() == 2
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(node)
