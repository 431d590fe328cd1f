"""Triton RMSNorm and fused residual-add + RMSNorm against the references."""

from __future__ import annotations

import pytest
import torch

from ringserve.kernels.layout import kernel_device
from ringserve.kernels.norm_reference import add_rmsnorm_reference, rmsnorm_reference
from ringserve.kernels.rmsnorm import add_rmsnorm, rmsnorm

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET is off and there is no CUDA device to run the kernels on",
)

EPS = 1e-5
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# float32 differs from the reference only in summation order; the half types
# by a rounding step or two (the interpreter truncates bfloat16 instead of rounding).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 3).to(DEVICE, dtype)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])  # ragged and exact blocks
def test_rmsnorm_matches_reference(dtype, hidden):
    x = rand(2, 3, hidden, dtype=dtype, seed=1)
    weight = rand(hidden, dtype=dtype, seed=2)
    assert_close(rmsnorm(x, weight, EPS), rmsnorm_reference(x, weight, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_matches_reference_and_leaves_inputs(dtype):
    x = rand(5, 48, dtype=dtype, seed=3)
    residual = rand(5, 48, dtype=dtype, seed=4)
    weight = rand(48, dtype=dtype, seed=5)
    x_before, residual_before = x.clone(), residual.clone()
    normed, summed = add_rmsnorm(x, residual, weight, EPS)
    expected_normed, expected_summed = add_rmsnorm_reference(x, residual, weight, EPS)
    assert_close(summed, expected_summed, dtype)
    assert_close(normed, expected_normed, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rmsnorm_promotes_to_a_float32_weight():
    x = rand(4, 32, dtype=torch.bfloat16, seed=6)
    weight = rand(32, dtype=torch.float32, seed=7)
    out = rmsnorm(x, weight, EPS)
    assert_close(out, rmsnorm_reference(x, weight, EPS), torch.bfloat16)


def test_rmsnorm_reads_rows_through_their_stride():
    wide = rand(6, 80, dtype=torch.float32, seed=8)
    x = wide[:, 16:64]
    weight = rand(48, dtype=torch.float32, seed=9)
    assert_close(rmsnorm(x, weight, EPS), rmsnorm_reference(x, weight, EPS), torch.float32)


def test_rmsnorm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match="weight has shape"):
        rmsnorm(
            rand(2, 32, dtype=torch.float32, seed=10), rand(16, dtype=torch.float32, seed=11), EPS
        )
