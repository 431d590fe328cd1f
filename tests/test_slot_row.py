"""A replica's slot rows: the same slots as the list they replace, through
any sequence of a pass's cuts and extensions, and the same batch built from
them."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from ringserve.engine.slot_row import SlotRow
from ringserve.kernels.batch import ForwardBatch

FIELDS = [f for f in ForwardBatch.__slots__]

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


def test_a_batch_from_slot_rows_is_the_batch_from_lists() -> None:
    rng = random.Random(5)
    for _ in range(30):
        lens = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 9))]
        rows = [rng.sample(range(1, 5000), n) for n in lens]
        decode = rng.random() < 0.5
        extend = [1 if decode else rng.randrange(1, n + 1) for n in lens]
        sample = [rng.random() < 0.7 for _ in lens]
        arrays = [SlotRow(r).array() for r in rows]
        want = ForwardBatch.build(rows, extend, sample)
        got = ForwardBatch.build(arrays, extend, sample)
        for name in FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), name
            else:
                assert a == b, name
