"""RMSNorm and fused residual-add + RMSNorm: torch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight (as HF Llama:
    `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`). torch's rms_norm
    without a weight upcasts half types and rounds once, so it is that
    expression bit for bit, in one kernel instead of six."""
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rmsnorm_reference(summed, weight, eps), summed
