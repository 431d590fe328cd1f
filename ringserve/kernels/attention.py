"""Paged attention: the torch reference every backend is compared with.

Layout of the KV pool for one layer: `k_cache`, `v_cache` of shape
[capacity, num_kv_heads, head_dim]. Queries are the flattened new tokens of a
`ForwardBatch`, shape [T, num_heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringserve.engine.batch import ForwardBatch


def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write the new tokens' K and V rows ([T, Hkv, D]) at their slots."""
    k_cache[out_slots] = k.to(k_cache.dtype)
    v_cache[out_slots] = v.to(v_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's pooled context
    (prefix slots and the new tokens before it). Returns [T, Hq, D]."""
    qp = q[batch.q_index].transpose(1, 2)  # [B, Hq, Q, D]
    k = k_cache[batch.req_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    v = v_cache[batch.req_slots].transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(
        qp, k, v, attn_mask=batch.attn_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)[batch.q_valid]
