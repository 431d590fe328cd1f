"""ForwardBatch: the decode fast path builds exactly the general tensors, and
rows of slots as arrays build exactly what lists do."""

from __future__ import annotations

import random

import torch

from ringserve.engine.slot_row import SlotRow
from ringserve.kernels.batch import ForwardBatch, packed_copy

FIELDS = [f for f in ForwardBatch.__slots__]


def test_decode_batch_equals_the_general_build() -> None:
    rng = random.Random(3)
    for _ in range(20):
        lens = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 9))]
        rows = [rng.sample(range(1, 500), n) for n in lens]
        sample = [rng.random() < 0.7 for _ in lens]
        fast = ForwardBatch.build(rows, [1] * len(rows), sample)
        width = max(lens)
        padded = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        general = ForwardBatch._extend(
            padded,
            torch.tensor(lens),
            torch.ones(len(rows), dtype=torch.int64),
            torch.tensor(sample),
            torch.device("cpu"),
        )
        assert_same_batch(fast, general)


def assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name


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
        assert_same_batch(ForwardBatch.build(arrays, extend, sample), want)


def test_a_packed_copy_gives_every_tensor_back_as_it_was() -> None:
    tensors = {
        "a": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([[True, False], [False, True]])[:, None],  # a view of a bool tensor
        "empty": torch.zeros(0, dtype=torch.int64),
        "b": torch.arange(10, 14, dtype=torch.int64)[::2],  # not contiguous
    }
    moved = packed_copy(tensors, torch.device("cpu"))
    assert moved.keys() == tensors.keys()
    for name, t in tensors.items():
        assert moved[name].dtype == t.dtype and torch.equal(moved[name], t), name
        assert moved[name].is_contiguous()
    # one buffer per dtype: the int64 tensors share one storage
    assert moved["a"].untyped_storage().data_ptr() == moved["b"].untyped_storage().data_ptr()


def test_off_the_cpu_a_pass_is_moved_packed_with_every_shape_and_dtype_kept() -> None:
    """The meta device stands for a GPU here: the batch goes through the
    packed copy, and every field keeps the CPU build's shape and dtype."""
    rng = random.Random(5)
    rows = [rng.sample(range(1, 500), n) for n in (7, 30, 12)]
    for extend in ([1, 1, 1], [3, 1, 12]):
        cpu = ForwardBatch.build(rows, extend, [True, False, True])
        meta = ForwardBatch.build(rows, extend, [True, False, True], "meta")
        assert (meta.num_tokens, meta.max_extend) == (cpu.num_tokens, cpu.max_extend)
        for name in FIELDS:
            here, there = getattr(cpu, name), getattr(meta, name)
            if isinstance(here, torch.Tensor):
                assert there.device.type == "meta", name
                assert (there.shape, there.dtype) == (here.shape, here.dtype), name
