"""The boot-time dry forward never writes outside the pool's usable slots."""

from __future__ import annotations

import pytest

from ringserve.engine.runner import dry_run_slots


@pytest.mark.parametrize(
    ("tokens", "rows", "capacity"),
    [(2048, 64, 65), (2048, 64, 33), (8, 64, 17), (100, 3, 1000), (5, 5, 6), (1, 1, 2)],
)
def test_dry_run_slots_stay_inside_the_pool_and_are_distinct(tokens, rows, capacity):
    rows_slots = dry_run_slots(tokens, rows, capacity)
    flat = [s for row in rows_slots for s in row]
    assert all(1 <= s < capacity for s in flat)
    assert len(flat) == len(set(flat))
    assert all(rows_slots), "every row has at least one token"
    assert len(flat) == min(max(tokens, min(rows, capacity - 1)), capacity - 1)
    assert len(rows_slots) == min(rows, capacity - 1)


def test_dry_run_of_a_pool_with_no_usable_slot_is_refused():
    with pytest.raises(ValueError, match="none usable"):
        dry_run_slots(8, 2, 1)
