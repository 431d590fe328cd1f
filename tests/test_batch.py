"""ForwardBatch: the decode fast path builds exactly the general tensors."""

from __future__ import annotations

import random

import torch

from ringserve.kernels.batch import ForwardBatch

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
        for name in FIELDS:
            a, b = getattr(fast, name), getattr(general, name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), name
            else:
                assert a == b, name
