"""A pass bound to the CPU kernels once (`NativePass`) computes what the
layers compute when each op checks its own call: the same bits out and the
same rows in the pool, for every family the native path takes, decode and
prefill, float32 and bfloat16; and `bind` refuses what the kernels cannot
take, so those passes keep the checked path."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

from ringserve.cache.pool import KVPool
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.cpu_native import CpuKernels
from ringserve.kernels.native_pass import NativePass
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model
from tests import model_factory

FAMILIES = {
    "llama_gqa": model_factory.llama_gqa,  # head 16: the native decode attention
    "qwen2_tied": model_factory.qwen2_tied,  # head 24, q/k/v biases: attention through ops
    "qwen3_qknorm": model_factory.qwen3_qknorm,  # q/k norms before the rope
}
CAPACITY = 256


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    built = CpuKernels.load(tmp_path_factory.mktemp("native"))
    if built is None:
        pytest.skip("the CPU kernels do not build here (see the log line)")
    return built


def passes(native: CpuKernels) -> list[ForwardBatch]:
    """A prefill of three sequences, then a decode step of each."""
    lens = [5, 9, 3]
    starts = [1, 40, 80]
    rows = [list(range(s, s + n)) for s, n in zip(starts, lens, strict=True)]
    prefill = ForwardBatch.build(rows, lens, [True] * 3, native=native)
    decode = ForwardBatch.build([r + [r[-1] + 1] for r in rows], [1] * 3, [True] * 3, native=native)
    return [prefill, decode]


def run(path: Path, dtype: torch.dtype, native: CpuKernels, bound: bool):
    """The model's outputs of both passes and its pool after them."""
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, range(cfg.num_layers), dtype)
    model.pack_linear_weights()
    pool = KVPool(cfg.num_layers, CAPACITY, cfg.num_kv_heads, cfg.head_dim, dtype)
    gen = torch.Generator().manual_seed(0)
    outs, bound_passes = [], []
    real_bind = NativePass.bind

    def spy(*args, **kwargs):
        bound_passes.append(real_bind(*args, **kwargs) if bound else None)
        return bound_passes[-1]

    with torch.inference_mode(), mock.patch.object(NativePass, "bind", spy):
        for batch in passes(native):
            tokens = torch.randint(3, cfg.vocab_size, (batch.num_tokens,), generator=gen)
            outs.append(model(tokens, batch, pool))
    assert len(bound_passes) == 2
    assert all((p is not None) == bound for p in bound_passes)  # bound, or refused
    return outs, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bound_pass_computes_the_checked_layers_bits(kernels, tmp_path, family, dtype):
    path = FAMILIES[family](tmp_path)
    (bound_outs, bound_pool), (checked_outs, checked_pool) = (
        run(path, dtype, kernels, bound) for bound in (True, False)
    )
    for ours, theirs in zip(bound_outs, checked_outs, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(
        bound_pool.k + bound_pool.v, checked_pool.k + checked_pool.v, strict=True
    ):
        assert torch.equal(ours, theirs)
    assert bound_pool.k[0].abs().sum() > 0  # the rope wrote its keys


def bind(kernels: CpuKernels, batch: ForwardBatch, x: torch.Tensor, pool: torch.Tensor):
    tokens, dim = batch.num_tokens, pool.shape[2]
    rope = (torch.ones(tokens, 1, dim, dtype=x.dtype), torch.zeros(tokens, 1, dim, dtype=x.dtype))
    return NativePass.bind(kernels, batch, x, rope, pool, (4, pool.shape[1], dim), 1e-6)


def test_bind_refuses_what_the_kernels_cannot_take(kernels):
    prefill, decode = passes(kernels)
    x = torch.randn(3, 64)
    pool = torch.zeros(CAPACITY, 2, 16)
    assert bind(kernels, decode, x, pool) is not None
    assert bind(kernels, decode, x.half(), pool.half()) is None  # no float16 kernels
    assert bind(kernels, decode, torch.randn(64, 3).t(), pool) is None  # rows not dense
    assert bind(kernels, decode, x, pool.bfloat16()) is None  # pool of another dtype
    assert bind(kernels, decode, x, pool[:, :, :8]) is None  # pool not contiguous
    assert bind(kernels, prefill, x, pool) is None  # 17 rows in the pass, 3 given
    narrow = dataclasses.replace(decode, out_slots=decode.out_slots.int())
    assert bind(kernels, narrow, x, pool) is None  # the kernel reads int64 slots


def test_decode_attention_is_native_only_where_its_kernel_applies(kernels):
    prefill, decode = passes(kernels)
    x, pool = torch.randn(3, 64), torch.zeros(CAPACITY, 2, 16)
    assert bind(kernels, decode, x, pool).decode
    assert not bind(kernels, prefill, torch.randn(17, 64), pool).decode
    assert not bind(kernels, decode, x, torch.zeros(CAPACITY, 2, 24)).decode  # head 24
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # more threads than sequences: SDPA splits heads too
    try:
        assert not bind(kernels, decode, x, pool).decode
    finally:
        torch.set_num_threads(threads)


def test_a_bound_pass_refuses_a_slot_outside_the_pool(kernels):
    _, decode = passes(kernels)
    x, pool = torch.randn(3, 64), torch.zeros(CAPACITY, 2, 16)
    bound = bind(kernels, decode, x, pool)
    bound.out_slots = torch.tensor([1, 2, CAPACITY])
    qk = torch.randn(3, 6, 16)
    with pytest.raises(IndexError, match="outside the KV pool"):
        bound.rope_store(qk, qk[:, 4:], pool, pool.clone())
    assert not pool.any()
