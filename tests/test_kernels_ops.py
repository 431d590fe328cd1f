"""The backend switch in ringserve.kernels.ops: CPU tensors take the torch
references, CUDA tensors the Triton kernels (checked natively by
bench/gpu_check.py; skipped where there is no CUDA device)."""

from __future__ import annotations

import pytest
import torch

from ringserve.kernels import ops
from ringserve.kernels.attention_reference import paged_attention_reference, store_kv_reference
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.decode_attention import decode_attention
from ringserve.kernels.extend_attention import extend_attention
from ringserve.kernels.norm_reference import add_rmsnorm_reference, rmsnorm_reference
from ringserve.kernels.rmsnorm import add_rmsnorm
from ringserve.kernels.sample import sample
from ringserve.kernels.sample_reference import sample_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def attention_case(extend_lens: list[int], device: str) -> tuple:
    gen = torch.Generator().manual_seed(0)
    rows = [list(range(10 * b + 1, 10 * b + 5)) for b in range(len(extend_lens))]
    batch = ForwardBatch.build(rows, extend_lens, [True] * len(rows), device)
    k = torch.randn(64, 2, 16, generator=gen).to(device)
    v = torch.randn(64, 2, 16, generator=gen).to(device)
    q = torch.randn(batch.num_tokens, 4, 16, generator=gen).to(device)
    return q, k, v, batch


def sampling_case(device: str) -> tuple:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen).to(device)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3], device=device)
    top_k = torch.tensor([0, 5, 0, 20], device=device)
    top_p = torch.tensor([1.0, 0.9, 0.8, 1.0], device=device)
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.1], device=device)
    return logits, temperature, top_k, top_p, min_p, torch.rand(4, 50, generator=gen).to(device)


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_switch_sends_cuda_tensors_to_triton_and_the_rest_to_torch():
    assert ops.uses_triton(torch.device("cuda"))
    assert ops.uses_triton(torch.device("cuda", 1))
    assert not ops.uses_triton(torch.device("cpu"))
    assert not ops.uses_triton(torch.device("meta"))


@pytest.mark.parametrize("extend_lens", [[1, 1], [3, 1]])
def test_cpu_kernels_runs_the_reference(extend_lens):
    q, k, v, batch = attention_case(extend_lens, "cpu")
    expected = paged_attention_reference(q, k, v, batch, 0.25)
    assert torch.equal(ops.paged_attention(q, k, v, batch, 0.25), expected)


def test_cpu_store_norm_and_sample_run_the_references():
    q, k, v, batch = attention_case([2, 1], "cpu")
    k_expected, v_expected = k.clone(), v.clone()
    store_kv_reference(k_expected, v_expected, batch.out_slots, q[:, :2], q[:, 2:])
    ops.store_kv(k, v, batch.out_slots, q[:, :2], q[:, 2:])
    assert torch.equal(k, k_expected) and torch.equal(v, v_expected)
    x, weight = q.reshape(3, -1), torch.rand(64)
    assert torch.equal(ops.rmsnorm(x, weight, 1e-6), rmsnorm_reference(x, weight, 1e-6))
    normed, summed = ops.add_rmsnorm(x, x, weight, 1e-6)
    expected_normed, expected_summed = add_rmsnorm_reference(x, x, weight, 1e-6)
    assert torch.equal(normed, expected_normed) and torch.equal(summed, expected_summed)
    case = sampling_case("cpu")
    assert same(ops.sample(*case), sample_reference(*case))


@needs_cuda
def test_cuda_attention_runs_decode_or_extend_kernel_by_batch():
    q, k, v, batch = attention_case([1, 1], "cuda")
    assert torch.equal(
        ops.paged_attention(q, k, v, batch, 0.25), decode_attention(q, k, v, batch, 0.25)
    )
    q, k, v, batch = attention_case([3, 1], "cuda")
    assert torch.equal(
        ops.paged_attention(q, k, v, batch, 0.25), extend_attention(q, k, v, batch, 0.25)
    )


@needs_cuda
def test_cuda_norm_and_sample_run_the_kernels():
    # Norm outputs differ from the reference's in the last bits, so equality
    # with the kernel shows which ran; sampling agrees by design, so it only
    # shows the CUDA path runs.
    x = torch.randn(3, 64, device="cuda")
    weight = torch.rand(64, device="cuda")
    assert same(ops.add_rmsnorm(x, x, weight, 1e-6), add_rmsnorm(x, x, weight, 1e-6))
    case = sampling_case("cuda")
    assert same(ops.sample(*case), sample(*case))
