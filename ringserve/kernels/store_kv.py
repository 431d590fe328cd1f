"""Triton KV store: writes one pass's new K and V rows into the pool at their
slots (the kernel behind `ops.store_kv`; reference: `store_kv_reference`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.layout import (
    require,
    require_index,
    require_pool,
    require_same_device,
    require_shape,
    tl_dtype,
)


@triton.jit
def _store_kv_kernel(
    k_cache,
    v_cache,
    out_slots,
    k,
    v,
    stride_cache_s,
    stride_cache_h,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
):
    # One program per new token: its [Hkv, D] rows of K and V.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    dst = slot * stride_cache_s + h[:, None] * stride_cache_h + d[None, :]
    k_row = tl.load(k + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache + dst, k_row.to(tl.float32).to(CACHE_DTYPE), mask=mask)
    v_row = tl.load(v + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache + dst, v_row.to(tl.float32).to(CACHE_DTYPE), mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write `k`, `v` ([T, Hkv, D], any token and head strides) at pool rows
    `out_slots` [T] of `k_cache`, `v_cache` ([capacity, Hkv, D], dense rows),
    cast to the pool's dtype. Slots must be distinct."""
    _check(k_cache, v_cache, out_slots, k, v)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k_cache,
        v_cache,
        out_slots,
        k,
        v,
        k_cache.stride(0),
        k_cache.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        CACHE_DTYPE=tl_dtype(k_cache),
    )


def _check(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    require_pool(k_cache, v_cache)
    require(out_slots.dim() == 1, f"out_slots must be 1-D, has shape {out_slots.shape}")
    require_index(out_slots, "out_slots")
    _, num_kv_heads, head_dim = k_cache.shape
    require_shape(k, (out_slots.shape[0], num_kv_heads, head_dim), "k")
    require_shape(v, tuple(k.shape), "v")
    require(k.stride(2) == 1 and v.stride(2) == 1, "k and v need a unit stride in head_dim")
    require_same_device(
        {"k_cache": k_cache, "v_cache": v_cache, "out_slots": out_slots, "k": k, "v": v}
    )
    tl_dtype(k)
    tl_dtype(v)
