"""Attention through torch within a gather limit: the reference's result,
to rounding, for every mix of cached prefixes, chunks and decoding rows;
its very bits where the batch fits the limit; and a peak that no longer
grows with the context."""

from __future__ import annotations

import random

import pytest
import torch

from ringserve.kernels.attention_bounded import paged_attention_bounded
from ringserve.kernels.attention_reference import paged_attention_reference
from ringserve.kernels.batch import ForwardBatch
from ringserve.plan.audit import measure_peak


def _case(seed: int, dtype: torch.dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hkv, group, dim, capacity = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), 32, 600
    k = torch.randn(capacity, hkv, dim, generator=gen).to(dtype)
    v = torch.randn(capacity, hkv, dim, generator=gen).to(dtype)
    free = rng.sample(range(1, capacity), capacity - 1)  # scattered, as a pool's slots are
    rows, news = [], []
    for _ in range(rng.randint(1, 5)):
        n = rng.randint(1, 110)
        rows.append([free.pop() for _ in range(n)])
        news.append(rng.randint(1, n) if rng.random() < 0.7 else 1)
    batch = ForwardBatch.build(rows, news, [True] * len(rows))
    q = torch.randn(batch.num_tokens, hkv * group, dim, generator=gen).to(dtype)
    return q, k, v, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [1, 3, 16, 40])
def test_the_bounded_attention_is_the_references(dtype, limit):
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for seed in range(15):
        q, k, v, batch = _case(seed, dtype)
        want = paged_attention_reference(q, k, v, batch, 0.125)
        got = paged_attention_bounded(q, k, v, batch, 0.125, limit)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol, (seed, batch.seq_lens.tolist(), batch.extend_lens.tolist(), err)


def test_a_batch_within_the_limit_is_the_reference_bit_for_bit():
    q, k, v, batch = _case(3, torch.float32)
    limit = batch.batch_size * int(batch.seq_lens.max())
    want = paged_attention_reference(q, k, v, batch, 0.125)
    assert torch.equal(paged_attention_bounded(q, k, v, batch, 0.125, limit), want)


def test_the_peak_does_not_grow_with_the_context():
    hkv, dim, new, limit = 4, 64, 32, 64
    k = torch.randn(8192, hkv, dim)
    v = torch.randn(8192, hkv, dim)
    peaks = {}
    for context in (128, 4096, 8000):
        batch = ForwardBatch.build([list(range(1, context + 1))], [new], [True])
        q = torch.randn(new, 2 * hkv, dim)
        peaks["reference", context] = measure_peak(
            torch.device("cpu"), lambda b=batch, q=q: paged_attention_reference(q, k, v, b, 0.125)
        )
        peaks["bounded", context] = measure_peak(
            torch.device("cpu"),
            lambda b=batch, q=q: paged_attention_bounded(q, k, v, b, 0.125, limit),
        )
    kv_rows = 2 * hkv * dim * 4  # one context token's K and V
    assert peaks["reference", 8000] > 8000 * kv_rows  # copies the whole context
    assert peaks["bounded", 8000] == peaks["bounded", 4096]
    assert peaks["bounded", 8000] < 2 * limit * kv_rows + 8 * new * 2 * hkv * dim * 4


def test_a_limit_below_one_token_is_refused():
    q, k, v, batch = _case(0, torch.float32)
    with pytest.raises(ValueError, match="at least one token"):
        paged_attention_bounded(q, k, v, batch, 0.125, 0)
