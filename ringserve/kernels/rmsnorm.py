"""Triton RMSNorm and fused residual-add + RMSNorm (references:
`rmsnorm_reference`, `add_rmsnorm_reference`).

Rounding follows the references step by step: the sum is rounded to the input
dtype before it is normalised, the normalised row is rounded to the input
dtype before the weight multiplies it, and the product is rounded once to the
promoted output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.layout import (
    require,
    require_inner_contiguous,
    require_same_device,
    require_shape,
    tl_dtype,
)


@triton.jit
def _rmsnorm_kernel(
    x,
    residual,
    weight,
    out,
    summed,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    X_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    xf = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (xf + r).to(X_DTYPE)
        tl.store(summed + row * stride_s + cols, s, mask=mask)
        xf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(X_DTYPE).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (w * normed).to(OUT_DTYPE), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` [..., H] with `weight` [H]."""
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual); inputs are not modified."""
    return _launch(x, residual, weight, eps)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, summed); without a residual `summed` is `normed`."""
    hidden = x.shape[-1]
    require_shape(weight, (hidden,), "weight")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        require_shape(residual, tuple(x.shape), "residual")
        require(residual.dtype == x.dtype, f"residual is {residual.dtype}, x is {x.dtype}")
        tensors["residual"] = residual
    require_same_device(tensors)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    rows = x.reshape(-1, hidden)
    res = rows if residual is None else residual.reshape(-1, hidden)
    require_inner_contiguous(rows, "x")
    require_inner_contiguous(res, "residual")
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(rows) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    if rows.shape[0] > 0:
        _rmsnorm_kernel[(rows.shape[0],)](
            rows,
            res,
            weight,
            out,
            summed,
            rows.stride(0),
            res.stride(0),
            out.stride(0),
            summed.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            X_DTYPE=tl_dtype(x),
            OUT_DTYPE=tl_dtype(out),
            num_warps=min(16, max(1, block // 256)),
        )
    return out.reshape(x.shape), summed.reshape(x.shape)
