"""Matmul weights in oneDNN's blocked layout, for bfloat16 on the CPU.

`F.linear` on a plain bfloat16 weight has oneDNN reorder the weight into its
blocked layout on every call; a weight reordered once at load time skips
that: a decode step's matmuls take 0.84-0.95 of their time at 1-32 rows and
0.65-0.90 at 64-1024 rows (one thread, the ~111M Llama's shapes, an AVX-512
CPU with AMX), with the same bits out, since both paths run the same oneDNN
kernels. A packed weight has the plain one's shape and
takes its place (the plain copy is freed), so memory does not grow; it is
opaque to every op but `linear`. float32 weights stay plain: oneDNN's
float32 matmul is faster from packed weights at 8-256 rows but slower at
one row (1.1-1.2x) than the BLAS path `F.linear` takes there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_pack(weight: torch.Tensor) -> bool:
    """A plain bfloat16 matrix on the CPU, with oneDNN in this torch build
    and bfloat16 matmuls in oneDNN on this CPU (AVX-512 or newer)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not weight.is_mkldnn
        and _onednn_bf16()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's layout for `linear`, tried once on a
    row of zeros; RuntimeError where oneDNN cannot run it."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    linear(torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a plain or a packed weight; `x` is
    [T, in]."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn_bf16() -> bool:
    try:
        mkldnn = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and bool(mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private ops: absent from some builds
        return False
