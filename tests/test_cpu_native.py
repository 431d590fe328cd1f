"""The CPU's in-place decode attention against the torch reference, its
fallback where it cannot build, and the engine's output with it and without."""

from __future__ import annotations

import os
import platform
import random
from pathlib import Path

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.cli import _config, parser
from ringserve.config import EngineConfig
from ringserve.kernels import ops
from ringserve.kernels.attention_reference import paged_attention_reference, store_kv_reference
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.cpu_native import CpuKernels
from ringserve.kernels.norm_reference import add_rmsnorm_reference, rmsnorm_reference
from ringserve.models.rope import apply_rope


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    """The kernels built for this CPU, and for AVX2 (x86-64-v3)."""
    if request.param != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64-v3 is an x86 target")
    built = CpuKernels.load(tmp_path_factory.mktemp("native"), march=request.param)
    if built is None:
        pytest.skip(f"the kernels do not build for {request.param} here (see the log line)")
    return built


def test_each_target_builds_its_vector_width(kernel, tmp_path):
    assert kernel.lanes in (8, 16)
    avx2 = CpuKernels.load(tmp_path, march="x86-64-v3")
    if avx2 is not None:
        assert avx2.lanes == 8


def decode_case(
    seed: int, bsz: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    """A pool of scattered rows and a decode batch over it: each sequence's
    slots are a random, unordered subset, its length anything from 1."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    capacity = bsz * max_len + 1
    k_cache = torch.randn(capacity, hkv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(capacity, hkv, dim, generator=gen).to(dtype)
    free = list(range(1, capacity))
    rng.shuffle(free)
    rows = []
    for _ in range(bsz):
        n = rng.randint(1, max_len)
        rows.append([free.pop() for _ in range(n)])
    q = torch.randn(bsz, hq, dim, generator=gen).to(dtype) * 2
    return q, k_cache, v_cache, ForwardBatch.build(rows, [1] * bsz, [True] * bsz)


SHAPES = [  # batch, query heads, KV heads, head dim, longest context
    (1, 4, 4, 16, 1),
    (5, 8, 2, 64, 40),
    (7, 16, 8, 64, 90),
    (3, 8, 1, 128, 300),
    (9, 6, 3, 32, 17),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_native_decode_attention_equals_the_reference(kernel, shape, dtype):
    q, k_cache, v_cache, batch = decode_case(sum(shape), *shape[:4], dtype, shape[4])
    assert kernel.supports_decode(q, k_cache, batch)
    scale = shape[3] ** -0.5
    got = kernel.decode_attention(q, k_cache, v_cache, batch, scale)
    want = paged_attention_reference(q, k_cache, v_cache, batch, scale)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:  # both accumulate in float32; they may round the last bit apart
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_a_mixed_pass_attends_each_kind_apart_and_equals_the_reference(kernel, seed, dtype):
    # decoding sequences with long contexts beside extensions (prefill chunks
    # after a prefix, and whole prompts) in one pass, their rows interleaved
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, 4000))
    rng.shuffle(free)
    rows, extend = [], []
    for _ in range(rng.randint(2, 9)):
        n = rng.randint(1, 300)
        rows.append([free.pop() for _ in range(n)])
        extend.append(1 if rng.random() < 0.6 else rng.randint(1, n))
    extend[0], extend[-1] = 1, max(2, min(len(rows[-1]), 5))
    rows[-1] += [free.pop() for _ in range(max(0, extend[-1] - len(rows[-1])))]
    k_cache = torch.randn(4000, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(4000, 2, 64, generator=gen).to(dtype)
    batch = ForwardBatch.build(rows, extend, [True] * len(rows), native=kernel)
    assert not batch.decode_only
    q = torch.randn(batch.num_tokens, 8, 64, generator=gen).to(dtype)
    got = ops.paged_attention(q, k_cache, v_cache, batch, 0.125)
    want = paged_attention_reference(q, k_cache, v_cache, batch, 0.125)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    parts = batch.mixed_parts()
    decoding = sum(e == 1 for e in extend)
    assert parts.decode is not None and parts.decode.batch_size == decoding
    assert parts.extend is not None and parts.extend.batch_size == len(rows) - decoding
    assert sorted(parts.decode_rows.tolist() + parts.extend_rows.tolist()) == list(
        range(batch.num_tokens)
    )


def test_native_threads_split_the_work_and_agree(kernel):
    q, k_cache, v_cache, batch = decode_case(3, 6, 8, 2, 64, torch.float32, 50)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.decode_attention(q, k_cache, v_cache, batch, 0.125)
        torch.set_num_threads(3)
        three = kernel.decode_attention(q, k_cache, v_cache, batch, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


def test_ops_attend_natively_only_where_the_kernel_applies(kernel):
    q, k_cache, v_cache, batch = decode_case(5, 4, 8, 4, 64, torch.float32, 30)
    batch.native = kernel
    torch.testing.assert_close(
        ops.paged_attention(q, k_cache, v_cache, batch, 0.125),
        paged_attention_reference(q, k_cache, v_cache, batch, 0.125),
    )
    rows = [list(range(1, 6)), list(range(6, 9))]
    extend = ForwardBatch.build(rows, [3, 2], [True, True], native=kernel)
    assert not kernel.supports_decode(
        torch.zeros(5, 8, 64), k_cache, extend
    )  # many queries per row
    odd = torch.zeros(4, 8, 24)  # a head size the 16 lanes do not divide
    assert not kernel.supports_decode(odd, torch.zeros(10, 4, 24), batch)
    assert not kernel.supports_decode(q.half(), k_cache.half(), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,width", [(1, 16), (7, 1024), (5, 40)])  # 40: no 16 lanes
def test_native_add_rmsnorm_equals_the_reference(kernel, rows, width, dtype):
    gen = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    assert kernel.supports_norm(x, weight)
    normed, summed = kernel.add_rmsnorm(x, residual, weight, 1e-6)
    want_normed, want_summed = add_rmsnorm_reference(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_summed)  # one rounded add: no room to differ
    alone, nothing = kernel.add_rmsnorm(x, None, weight, 1e-6)
    assert nothing is None
    if dtype == torch.float32:
        torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone, rmsnorm_reference(x, weight, 1e-6), atol=1e-5, rtol=1e-5)
    else:  # the float32 mean may round apart, and then one bfloat16 step
        torch.testing.assert_close(normed.float(), want_normed.float(), atol=0, rtol=1e-2)
        torch.testing.assert_close(
            alone.float(), rmsnorm_reference(x, weight, 1e-6).float(), atol=0, rtol=1e-2
        )
        assert (normed == want_normed).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 16), (6, 2816), (3, 40)])
def test_native_silu_mul_equals_torch(kernel, rows, inter, dtype):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's far ends
    assert kernel.supports_silu_mul(gate_up)
    got = kernel.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == (rows, inter) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # silu rounds to bfloat16 before the product, in both
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        assert (got == want).float().mean() > 0.98
    nan = gate_up.clone()
    nan[0, 0] = float("nan")
    assert kernel.silu_mul(nan)[0, 0].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,hq,hkv,dim", [(1, 4, 4, 16), (9, 16, 8, 64), (5, 6, 2, 10)])
def test_native_rope_store_equals_rope_then_store(kernel, tokens, hq, hkv, dim, dtype):
    gen = torch.Generator().manual_seed(tokens * dim)
    # q, k and v heads of one projection: qk and v are views with a row stride
    heads = torch.randn(tokens, hq + 2 * hkv, dim, generator=gen).to(dtype)
    qk, v = heads.split([hq + hkv, hkv], dim=1)
    angles = torch.rand(tokens, 1, dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    sin[..., : dim // 2] *= -1
    slots = torch.randperm(3 * tokens, generator=gen)[:tokens]
    pools = [torch.zeros(3 * tokens, hkv, dim, dtype=dtype) for _ in range(4)]
    assert kernel.supports_rope_store(qk, v, cos, pools[0], pools[1])
    q = kernel.rope_store(qk, v, cos, sin, pools[0], pools[1], slots)
    want_q, want_k = apply_rope(qk, cos, sin).split([hq, hkv], dim=1)
    store_kv_reference(pools[2], pools[3], slots, want_k, v)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q.float(), want_q.float(), **tol)
    torch.testing.assert_close(pools[0].float(), pools[2].float(), **tol)
    assert torch.equal(pools[1], pools[3])  # values are copied as they are
    untouched = torch.ones(3 * tokens, dtype=torch.bool)
    untouched[slots] = False
    assert not pools[0][untouched].any()  # nothing written outside the slots


def test_norms_take_the_kernel_only_for_rows_it_knows(kernel):
    weight = torch.ones(64)
    assert not kernel.supports_norm(torch.zeros(4, 2, 64), weight)  # heads: not rows
    assert not kernel.supports_norm(torch.zeros(64, 4).t(), weight)  # not contiguous
    assert not kernel.supports_norm(torch.zeros(4, 64).half(), weight.half())
    assert not kernel.supports_norm(torch.zeros(4, 64), torch.ones(32))
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    torch.testing.assert_close(
        ops.add_rmsnorm(x, residual, weight, 1e-5, kernel),
        add_rmsnorm_reference(x, residual, weight, 1e-5),
    )


def test_no_compiler_or_a_failed_compile_leaves_the_torch_path(tmp_path, monkeypatch):
    from structlog.testing import capture_logs

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with capture_logs() as said:
        assert CpuKernels.load(tmp_path / "a") is None
    assert said[-1]["reason"] == f"no C compiler: $CC={tmp_path / 'no-such-cc'} is not on PATH"
    monkeypatch.setenv("CC", "false")  # found on PATH, fails every command
    assert CpuKernels.load(tmp_path / "b") is None
    assert not any((tmp_path / "b").glob("*.so"))  # no half-written library left


@pytest.mark.timeout(120)
def test_an_engine_without_a_compiler_serves_on_the_torch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(torch_threads=1)
    try:
        assert llm._ring.conductor.stage.runner.native is None
        out = llm.generate([[5, 9, 14]], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out[0].token_ids) == 6
    finally:
        llm.close()


def test_a_cached_build_is_reused(kernel, tmp_path):
    first = CpuKernels.load(tmp_path)
    assert first is not None
    libraries = list(tmp_path.glob("*.so"))
    assert len(libraries) == 1
    stamp = libraries[0].stat().st_mtime_ns
    assert CpuKernels.load(tmp_path) is not None
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("*.so")] == [stamp]


def test_cpu_kernels_must_be_a_known_choice():
    with pytest.raises(ValueError, match="cpu_kernels"):
        EngineConfig(model_dir=Path("."), cpu_kernels="fast")


def test_the_command_line_chooses_the_cpu_kernels():
    assert _config(parser().parse_args(["launch"])).cpu_kernels == "native"
    chosen = _config(parser().parse_args(["launch", "--cpu-kernels", "torch"]))
    assert chosen.cpu_kernels == "torch"
    with pytest.raises(SystemExit):
        parser().parse_args(["launch", "--cpu-kernels", "fast"])


@pytest.mark.timeout(240)
def test_the_engine_decodes_the_same_tokens_with_either_attention(kernel):
    prompts = [[5, 9, 14, 3], [7] * 12, list(range(3, 40))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for choice in ("native", "torch"):
        llm = LLM(cpu_kernels=choice, torch_threads=1)
        try:
            runner = llm._ring.conductor.stage.runner
            assert (runner.native is not None) == (choice == "native")
            outputs[choice] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    assert outputs["native"] == outputs["torch"]
    assert all(len(t) == 24 for t in outputs["native"])


@pytest.mark.parametrize("bad", [-1, 0], ids=["negative", "past-the-end"])
def test_a_slot_outside_the_pool_is_an_index_error_and_touches_nothing(kernel, bad):
    q, k_cache, v_cache, batch = decode_case(3, 4, 8, 2, 64, torch.float32, 20)
    capacity = k_cache.shape[0]
    slot = bad if bad < 0 else capacity + bad  # capacity itself is one past the last row
    batch.req_slots[2, 0] = slot
    with pytest.raises(IndexError, match="outside the KV pool"):
        kernel.decode_attention(q, k_cache, v_cache, batch, 0.125)
    # the rope store writes nothing when any token's slot is outside the pool
    heads = torch.randn(3, 8 + 2 * 2, 64)
    qk, v = heads.split([8 + 2, 2], dim=1)
    angles = torch.rand(3, 1, 64)
    pools = (k_cache.clone(), v_cache.clone())
    with pytest.raises(IndexError, match="outside the KV pool"):
        kernel.rope_store(qk, v, angles.cos(), angles.sin(), *pools, torch.tensor([1, slot, 2]))
    assert torch.equal(pools[0], k_cache) and torch.equal(pools[1], v_cache)


def test_a_context_longer_than_its_slot_table_is_an_index_error(kernel):
    q, k_cache, v_cache, batch = decode_case(4, 3, 8, 2, 64, torch.float32, 10)
    batch.seq_lens[1] = batch.req_slots.shape[1] + 1
    with pytest.raises(IndexError, match="past its slot table"):
        kernel.decode_attention(q, k_cache, v_cache, batch, 0.125)


@pytest.mark.timeout(120)
def test_a_damaged_cached_library_is_built_again_not_loaded(tmp_path):
    """A truncated library, loaded, ends the process (SIGBUS): the digest
    written beside it at build tells it apart, and it is built again."""
    first = CpuKernels.load(tmp_path)
    if first is None:
        pytest.skip("the kernels do not build here (see the log line)")
    from ringserve.kernels.cpu_native import _whole

    (library,) = tmp_path.glob("cpu_kernels-*.so")
    whole = library.read_bytes()
    for damage in (whole[:1000], b""):
        # a new file in its place: this process maps the first one, whose
        # pages must stay as they are
        (tmp_path / "damaged").write_bytes(damage)
        os.replace(tmp_path / "damaged", library)
        assert not _whole(library)
        again = CpuKernels.load(tmp_path)
        assert again is not None and again.lanes == first.lanes
        assert _whole(library) and len(library.read_bytes()) == len(whole)  # built again
