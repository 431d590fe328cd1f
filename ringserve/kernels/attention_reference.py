"""Paged attention: the torch reference every backend is compared with.

Layout of the KV pool for one layer: `k_cache`, `v_cache` of shape
[capacity, num_kv_heads, head_dim]. Queries are the flattened new tokens of a
`ForwardBatch`, shape [T, num_heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringserve.kernels.batch import ForwardBatch


def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write the new tokens' K and V rows ([T, Hkv, D]) at their slots."""
    k_cache.index_copy_(0, out_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, out_slots, v.to(v_cache.dtype))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's pooled context
    (prefix slots and the new tokens before it). Returns [T, Hq, D]."""
    bsz, width = batch.req_slots.shape
    flat = batch.req_slots.view(-1)
    # index_select on the flattened slots is much cheaper on CPU than
    # advanced indexing with a 2-D index.
    k = k_cache.index_select(0, flat).view(bsz, width, *k_cache.shape[1:])
    v = v_cache.index_select(0, flat).view(bsz, width, *v_cache.shape[1:])
    k = k.transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    v = v.transpose(1, 2).to(q.dtype)
    if batch.decode_only:  # one query per sequence: rows are already in order
        qp = q[:, None].transpose(1, 2)  # [B, Hq, 1, D]
    else:
        qp = q.index_select(0, batch.q_index.view(-1)).view(bsz, -1, *q.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qp, k, v, attn_mask=batch.attn_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    out = out.transpose(1, 2)  # [B, Q, Hq, D]
    if batch.decode_only:
        return out[:, 0]
    return out.reshape(-1, *out.shape[2:]).index_select(0, batch.valid_rows)
