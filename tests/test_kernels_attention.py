"""Triton decode and extend attention against the torch reference, on pools
whose slots are scattered by a random permutation. On the CPU the kernels run
under TRITON_INTERPRET=1 (set by conftest); bench/gpu_check.py reruns this
file natively on CUDA."""

from __future__ import annotations

import pytest
import torch

from ringserve.kernels.attention_reference import paged_attention_reference
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.decode_attention import decode_attention
from ringserve.kernels.extend_attention import extend_attention
from ringserve.kernels.layout import kernel_device

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET is off and there is no CUDA device to run the kernels on",
)

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
# (query heads, KV heads): plain multi-head, GQA ratio 4, all heads on one KV head.
HEADS = [(2, 2), (8, 2), (8, 1)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def scattered_batch(prefix_lens: list[int], extend_lens: list[int], seed: int) -> ForwardBatch:
    """Sequences whose contexts sit at randomly permuted slots (never slot 0)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    gen = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(sum(seq_lens) + 7, generator=gen) + 1).tolist()
    rows, start = [], 0
    for n in seq_lens:
        rows.append(perm[start : start + n])
        start += n
    return ForwardBatch.build(rows, extend_lens, [True] * len(rows), DEVICE)


def random_case(
    batch: ForwardBatch, heads: tuple[int, int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and a pool covering the batch's slots; slot 0 holds large
    values, so reading padding would show."""
    num_heads, num_kv_heads = heads
    capacity = int(batch.req_slots.max()) + 8
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(capacity, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(capacity, num_kv_heads, HEAD_DIM, generator=gen)
    k[0], v[0] = 50.0, 50.0
    q = torch.randn(batch.num_tokens, num_heads, HEAD_DIM, generator=gen)
    return tuple(t.to(DEVICE, dtype) for t in (q, k, v))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch):
    """The reference in float32 over the same (already rounded) inputs."""
    return paged_attention_reference(q.float(), k.float(), v.float(), batch, SCALE)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# Context lengths 1, 17, 40 and 75 against 16-key blocks: a single key, ragged
# last blocks, and (with 3 splits) splits that are empty for short sequences.
DECODE_PREFIXES = [0, 16, 39, 74]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_reference(heads, dtype, num_splits):
    batch = scattered_batch(DECODE_PREFIXES, [1] * 4, seed=1)
    q, k, v = random_case(batch, heads, dtype, seed=2)
    out = decode_attention(q, k, v, batch, SCALE, num_splits=num_splits, block_n=16)
    assert_close(out, reference(q, k, v, batch), dtype)


def test_decode_attention_covers_groups_wider_than_one_head_block():
    # 20 query heads on one KV head: two 16-row head blocks, the second ragged.
    batch = scattered_batch([0, 30], [1, 1], seed=3)
    q, k, v = random_case(batch, (20, 1), torch.float32, seed=4)
    out = decode_attention(q, k, v, batch, SCALE, num_splits=2, block_n=16)
    assert_close(out, reference(q, k, v, batch), torch.float32)


def test_decode_attention_default_splits_cover_long_contexts():
    batch = scattered_batch([600, 4, 299], [1, 1, 1], seed=5)
    q, k, v = random_case(batch, (8, 2), torch.float32, seed=6)
    out = decode_attention(q, k, v, batch, SCALE)
    assert_close(out, reference(q, k, v, batch), torch.float32)


def test_decode_attention_rejects_a_prefill_batch():
    batch = scattered_batch([0, 3], [1, 2], seed=7)
    q, k, v = random_case(batch, (2, 2), torch.float32, seed=8)
    with pytest.raises(ValueError, match="one new token per sequence"):
        decode_attention(q, k, v, batch, SCALE)


# (prefix, new tokens): no prefix, single new tokens (decode rows in a mixed
# pass), runs that are not multiples of 16, one that spans three query blocks.
EXTEND_PREFIXES = [0, 0, 13, 5, 40, 16]
EXTEND_LENS = [1, 20, 1, 17, 33, 16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_extend_attention_matches_reference(heads, dtype):
    batch = scattered_batch(EXTEND_PREFIXES, EXTEND_LENS, seed=9)
    q, k, v = random_case(batch, heads, dtype, seed=10)
    out = extend_attention(q, k, v, batch, SCALE, block_m=16, block_n=16)
    assert_close(out, reference(q, k, v, batch), dtype)


def test_extend_attention_default_blocks_match_reference():
    batch = scattered_batch([0, 70, 3], [90, 5, 1], seed=11)
    q, k, v = random_case(batch, (8, 2), torch.float32, seed=12)
    out = extend_attention(q, k, v, batch, SCALE)
    assert_close(out, reference(q, k, v, batch), torch.float32)


def test_extend_attention_reads_queries_through_their_strides():
    # q as the middle slice of a fused projection, as the layers produce it.
    batch = scattered_batch([4, 0], [9, 3], seed=13)
    q, k, v = random_case(batch, (4, 2), torch.float32, seed=14)
    fused = torch.cat([torch.zeros_like(q), q, torch.zeros_like(q)], dim=1)
    out = extend_attention(fused[:, 4:8], k, v, batch, SCALE, block_m=16, block_n=16)
    assert_close(out, reference(q, k, v, batch), torch.float32)


def test_attention_wrappers_reject_mismatched_heads():
    batch = scattered_batch([2], [1], seed=15)
    q, k, v = random_case(batch, (3, 2), torch.float32, seed=16)
    with pytest.raises(ValueError, match="not a multiple"):
        extend_attention(q, k, v, batch, SCALE)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, k, v, batch, SCALE)
