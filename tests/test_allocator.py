from __future__ import annotations

import pytest

from ringserve.cache.allocator import OutOfSlots, SlotAllocator


def test_capacity_without_a_usable_slot_is_rejected():
    with pytest.raises(ValueError, match="no usable slot"):
        SlotAllocator(1)


def test_alloc_hands_out_lowest_slots_and_never_slot_zero():
    alloc = SlotAllocator(8)
    assert alloc.available == 7
    assert alloc.alloc(3) == [1, 2, 3]
    assert alloc.alloc(4) == [4, 5, 6, 7]
    assert (alloc.available, alloc.used) == (0, 7)


def test_alloc_of_zero_is_empty_and_negative_is_refused():
    alloc = SlotAllocator(4)
    assert alloc.alloc(0) == []
    with pytest.raises(ValueError):
        alloc.alloc(-1)
    assert alloc.available == 3


def test_alloc_beyond_available_raises_out_of_slots_with_both_figures():
    alloc = SlotAllocator(6)
    alloc.alloc(2)
    with pytest.raises(OutOfSlots, match="asked for 4 KV slots but only 3 are available") as err:
        alloc.alloc(4)
    assert (err.value.asked, err.value.available) == (4, 3)
    assert alloc.available == 3
    assert alloc.alloc(3) == [3, 4, 5]


def test_freed_slots_are_available_again():
    alloc = SlotAllocator(5)
    slots = alloc.alloc(4)
    alloc.free(slots[1:3])
    assert (alloc.available, alloc.used) == (2, 2)
    assert alloc.alloc(2) == [2, 3]


def test_alloc_order_does_not_depend_on_free_order():
    a, b = SlotAllocator(10), SlotAllocator(10)
    a.alloc(9)
    b.alloc(9)
    a.free([7, 2, 5])
    b.free([5, 7, 2])
    assert a.alloc(3) == b.alloc(3) == [2, 5, 7]


def test_double_free_raises_and_changes_nothing():
    alloc = SlotAllocator(5)
    slots = alloc.alloc(2)
    alloc.free(slots)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        alloc.free([1])
    assert alloc.available == 4


def test_free_of_padding_slot_or_out_of_range_raises():
    alloc = SlotAllocator(5)
    alloc.alloc(4)
    with pytest.raises(ValueError, match="padding"):
        alloc.free([0])
    for bad in (5, -1):
        with pytest.raises(ValueError, match="outside 1..4"):
            alloc.free([bad])
    assert alloc.used == 4


def test_free_is_all_or_nothing_when_one_slot_is_bad():
    alloc = SlotAllocator(5)
    alloc.alloc(4)
    with pytest.raises(ValueError):
        alloc.free([1, 2, 2])
    with pytest.raises(ValueError):
        alloc.free([3, 0])
    assert alloc.used == 4
    alloc.free([1, 2, 3, 4])
    assert alloc.available == 4


def test_free_group_counts_staged_slots_as_available():
    alloc = SlotAllocator(6)
    slots = alloc.alloc(5)
    with alloc.free_group():
        alloc.free(slots[:3])
        assert (alloc.available, alloc.used) == (3, 2)
    assert alloc.available == 3


def test_staged_slots_can_be_allocated_inside_the_group():
    alloc = SlotAllocator(4)
    slots = alloc.alloc(3)
    with alloc.free_group():
        alloc.free(slots)
        assert alloc.alloc(3) == [1, 2, 3]
    assert alloc.available == 0


def test_alloc_inside_group_prefers_free_slots_to_staged_ones():
    alloc = SlotAllocator(4)
    alloc.alloc(2)
    with alloc.free_group():
        alloc.free([1])
        assert alloc.alloc(1) == [3]
    assert alloc.alloc(1) == [1]


def test_nested_free_groups_merge_at_the_outermost_exit():
    alloc = SlotAllocator(4)
    alloc.alloc(2)
    with alloc.free_group():
        with alloc.free_group():
            alloc.free([1])
        assert alloc.alloc(1) == [3]  # slot 1 still staged: free slot 3 comes first
        alloc.free([3])
    assert alloc.alloc(2) == [1, 3]


def test_free_group_closes_and_merges_when_the_body_raises():
    alloc = SlotAllocator(4)
    alloc.alloc(2)
    with pytest.raises(KeyError), alloc.free_group():
        alloc.free([2])
        raise KeyError("pass failed")
    assert alloc.alloc(1) == [2]  # merged: no longer behind free slot 3
    alloc.free([2])
    assert alloc.alloc(1) == [2]  # and the group is closed: frees go straight back


def test_double_free_of_a_staged_slot_raises():
    alloc = SlotAllocator(4)
    alloc.alloc(2)
    with alloc.free_group():
        alloc.free([1])
        with pytest.raises(ValueError, match="not allocated"):
            alloc.free([1])
    assert alloc.available == 2
