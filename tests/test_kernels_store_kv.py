"""Triton KV store against the torch reference: rows land at scattered slots,
every other slot is left as it was."""

from __future__ import annotations

import pytest
import torch

from ringserve.kernels.attention_reference import store_kv_reference
from ringserve.kernels.layout import kernel_device
from ringserve.kernels.store_kv import store_kv

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET is off and there is no CUDA device to run the kernels on",
)

CAPACITY, KV_HEADS, HEAD_DIM = 64, 3, 20  # neither head count nor head_dim a power of 2


def pools(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (CAPACITY, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def new_rows(num_tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Scattered distinct slots, and K/V as strided views of one fused
    projection, the way the layers hand them over."""
    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(CAPACITY - 1, generator=gen)[:num_tokens] + 1).to(DEVICE)
    fused = torch.randn(num_tokens, 3 * KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    return slots, fused[:, KV_HEADS : 2 * KV_HEADS], fused[:, 2 * KV_HEADS :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_store_kv_writes_rows_at_their_slots_only(dtype, num_tokens):
    k_cache, v_cache = pools(dtype, seed=num_tokens)
    slots, k, v = new_rows(num_tokens, dtype, seed=num_tokens + 1)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_reference(k_expected, v_expected, slots, k, v)
    store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_store_kv_casts_rows_to_the_pool_dtype():
    k_cache, v_cache = pools(torch.float16, seed=3)
    slots, k, v = new_rows(5, torch.float32, seed=4)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_reference(k_expected, v_expected, slots, k, v)
    store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_store_kv_rejects_rows_of_the_wrong_shape():
    k_cache, v_cache = pools(torch.float32, seed=5)
    slots, k, v = new_rows(4, torch.float32, seed=6)
    with pytest.raises(ValueError, match="k has shape"):
        store_kv(k_cache, v_cache, slots[:3], k, v)
