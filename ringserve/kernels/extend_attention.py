"""Triton paged extend (prefill) attention with a cached prefix (reference:
`paged_attention_reference`).

The layers store a pass's new K/V in the pool before attention, so a
sequence's whole context, prefix and new tokens alike, is read through
`req_slots`: new token i of sequence b sits at position prefix_len[b] + i and
sees every key at a position up to its own. One program handles a block of one
sequence's new tokens for one query head, with an online softmax over key
blocks up to the block's last position.
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


@triton.jit
def _extend_kernel(
    q,
    k_cache,
    v_cache,
    out,
    req_slots,
    seq_lens,
    extend_lens,
    qo_indptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cs,
    stride_ch,
    stride_rb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    extend = tl.load(extend_lens + b).to(tl.int32)
    if m0 >= extend:
        return
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    prefix = seq_len - extend
    rows = tl.load(qo_indptr + b) + m0 + tl.arange(0, BLOCK_M)
    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < extend
    q_pos = prefix + m
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    q_mask = m_mask[:, None] & d_mask[None, :]
    q_ptrs = q + rows[:, None] * stride_qt + head * stride_qh + d[None, :]
    q_blk = tl.load(q_ptrs, mask=q_mask, other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The block's last row sees keys up to its own position.
    end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slots = tl.load(req_slots + b * stride_rb + n, mask=n_mask, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_blk = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q_blk, tl.trans(k_blk), input_precision=DOT_PRECISION)
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s * scale_log2, float("-inf"))
        # Key 0 is visible to every row, so the first block makes m_i finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_blk = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        pv = tl.dot(p.to(DOT_DTYPE), v_blk, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / l_i[:, None]
    dst = out + rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, o.to(OUT_DTYPE), mask=q_mask)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Causal attention of the batch's new tokens (`q` [T, Hq, D], flattened
    by `batch.qo_indptr`) over their sequences' pooled contexts, which already
    hold the new tokens' K/V. Returns [T, Hq, D] in q's dtype."""
    require_attention(q, k_cache, v_cache, batch)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        require(size >= 16 and size & (size - 1) == 0, f"{name} {size}: power of 2 >= 16")
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    grid = (batch.batch_size, num_heads, triton.cdiv(batch.max_extend, block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        batch.req_slots,
        batch.seq_lens,
        batch.extend_lens,
        batch.qo_indptr,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        batch.req_slots.stride(0),
        GROUP=num_heads // k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_DTYPE=dot_dtype(q),
        DOT_PRECISION=dot_precision(q),
        OUT_DTYPE=tl_dtype(q),
        num_warps=4,
        num_stages=2,
    )
    return out
