"""Triton paged decode attention: one new query token per sequence over its
pooled context, split-K in two stages (reference: `paged_attention_reference`).

Stage 1 runs one program per (sequence, block of query heads sharing one KV
head, split of the context): it reads each K/V row once for the whole head
block and writes that split's normalised output and log-sum-exp. Stage 2
merges a sequence's splits per head. Splitting keeps the GPU busy when there
are few sequences but long contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.layout import (
    dot_dtype,
    dot_precision,
    require,
    require_attention,
    tl_dtype,
)

LOG2E = 1.4426950408889634
# tl.dot needs at least 16 rows on the GPU; a KV head's query heads are padded to it.
BLOCK_H = 16
MAX_SPLITS = 16
TOKENS_PER_SPLIT = 256


@triton.jit
def _decode_partial_kernel(
    q,
    k_cache,
    v_cache,
    req_slots,
    seq_lens,
    part_out,
    part_lse,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_rb,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    g = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + g
    head_mask = g < GROUP
    split = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # Splits cover whole key blocks so only a split's last block is ragged.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q_mask = head_mask[:, None] & d_mask[None, :]
    q_ptrs = q + b * stride_qb + head[:, None] * stride_qh + d[None, :]
    q_blk = tl.load(q_ptrs, mask=q_mask, other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slots = tl.load(req_slots + b * stride_rb + n, mask=n_mask, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_blk = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q_blk, tl.trans(k_blk), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every block holds at least one live key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_blk = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v_blk, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (short sequence) leaves l_i == 0: output 0, lse -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    part = (b * NUM_HEADS + head) * num_splits + split
    tl.store(
        part_out + part[:, None] * HEAD_DIM + d[None, :],
        acc / l_safe[:, None],
        mask=q_mask,
    )
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_lse + part, lse, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out,
    part_lse,
    out,
    stride_ob,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    part = (b * NUM_HEADS + h) * num_splits + s
    lse = tl.load(part_lse + part, mask=s_mask, other=float("-inf"))
    # Split 0 always holds the sequence's first key, so the max is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        part_out + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    merged = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
    tl.store(out + b * stride_ob + h * stride_oh + d, merged.to(OUT_DTYPE), mask=d_mask)


def default_num_splits(context_width: int) -> int:
    """Splits for a batch whose longest context is `context_width` tokens."""
    return max(1, min(MAX_SPLITS, triton.cdiv(context_width, TOKENS_PER_SPLIT)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of each sequence's one new token (`q` [B, Hq, D]) over its
    context slots `batch.req_slots[b, :seq_lens[b]]`, which already hold the
    new token's K/V. Returns [B, Hq, D] in q's dtype."""
    require_attention(q, k_cache, v_cache, batch)
    require(batch.decode_only, "decode attention needs one new token per sequence")
    require(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n {block_n}: power of 2 >= 16")
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    splits = default_num_splits(batch.req_slots.shape[1]) if num_splits is None else num_splits
    require(splits >= 1, f"num_splits must be >= 1, is {splits}")
    group = num_heads // num_kv_heads
    head_blocks = triton.cdiv(group, BLOCK_H)
    part_out = torch.empty(bsz, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz, num_heads, splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_partial_kernel[(bsz, num_kv_heads * head_blocks, splits)](
        q,
        k_cache,
        v_cache,
        batch.req_slots,
        batch.seq_lens,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        batch.req_slots.stride(0),
        splits,
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=BLOCK_H,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype(q),
        DOT_PRECISION=dot_precision(q),
        num_warps=4,
        num_stages=2,
    )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _decode_reduce_kernel[(bsz, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        OUT_DTYPE=tl_dtype(q),
    )
    return out
