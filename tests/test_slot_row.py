"""A replica's slot rows: the same slots as the list they replace, through
any sequence of a pass's cuts and extensions (the batch built from them:
test_batch.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ringserve.engine.slot_row import SlotRow

slots = st.lists(st.integers(0, 2**40), max_size=40)


@given(st.lists(slots, max_size=4), st.lists(st.tuples(st.integers(-3, 80), slots), max_size=30))
def test_a_slot_row_holds_what_a_list_would(first: list[list[int]], steps) -> None:
    model = [s for part in first for s in part]
    row = SlotRow(model)
    for keep, new in steps:  # a pass: back to `keep` slots, then its new ones
        row.cut(keep)
        del model[max(0, keep) :]
        row.extend(new)
        model.extend(new)
        assert len(row) == len(model) and row.tolist() == model
    assert row.array().dtype == np.int64
