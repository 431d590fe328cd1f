"""Decode passes through the static buffers that CUDA graphs replay
(models/decode_graphs.py): off a GPU the same buffers run op by op, so the
CPU checks here that a pass written into them, padded to its bucket, computes
what the pass built as usual computes, on the first stage and downstream.
Replaying real graphs is checked on a GPU (tests/test_gpu_engine.py)."""

from __future__ import annotations

import random

import pytest
import torch

from ringserve.cache.pool import KVPool
from ringserve.kernels.batch import ForwardBatch
from ringserve.models.config import ModelConfig
from ringserve.models.decode_graphs import DecodeGraphs, row_bucket, width_bucket
from ringserve.models.loader import load_model
from tests import model_factory

CAPACITY = 600


def test_rows_and_widths_go_to_the_smallest_bucket_that_holds_them():
    assert [row_bucket(n, 64) for n in (1, 3, 5, 17, 33, 64)] == [1, 4, 8, 24, 48, 64]
    assert row_bucket(65, 64) is None
    assert row_bucket(50, 50) == 50  # the largest bucket is the most rows
    assert [width_bucket(w, 600) for w in (1, 256, 257, 513, 600)] == [256, 256, 512, 600, 600]
    assert width_bucket(601, 600) is None


@pytest.fixture(scope="module", params=["llama_gqa", "bigcode_mqa"])
def model_dir(request, tmp_path_factory):
    return getattr(model_factory, request.param)(tmp_path_factory.mktemp(request.param))


def prefilled(model_dir, layers: range, contexts: list[list[int]]):
    """A slice and its pool holding `contexts`' K/V (their last slot left for the decode)."""
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, layers, torch.float32)
    pool = KVPool(len(layers), CAPACITY, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    prompts = [c[:-1] for c in contexts]
    batch = ForwardBatch.build(prompts, [len(p) for p in prompts], [True] * len(prompts))
    with torch.inference_mode():
        model(pool_input(model, cfg, layers, batch.num_tokens, seed=1), batch, pool)
    return cfg, model, pool


def pool_input(model, cfg, layers: range, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if layers.start == 0:
        return torch.randint(2, cfg.vocab_size, (tokens,), generator=gen)
    return torch.randn(tokens, cfg.hidden_size, generator=gen)


@pytest.mark.parametrize("downstream", [False, True], ids=["first_stage", "downstream"])
def test_a_decode_pass_through_the_static_buffers_equals_the_built_pass(model_dir, downstream):
    rng = random.Random(0)
    slots = rng.sample(range(1, CAPACITY), 3 * 120)  # scattered, as a pool hands them out
    contexts = [slots[:37], slots[120:120 + 300], slots[240:240 + 5]]  # fmt: skip
    cfg = ModelConfig.from_dir(model_dir)
    layers = range(2, cfg.num_layers) if downstream else range(cfg.num_layers)
    _, model, pool = prefilled(model_dir, layers, contexts)
    twin = KVPool(len(layers), CAPACITY, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    for j in range(len(layers)):
        twin.k[j].copy_(pool.k[j])
        twin.v[j].copy_(pool.v[j])
    x = pool_input(model, cfg, layers, len(contexts), seed=2)
    sample = [True, False, True]
    with torch.inference_mode():
        built = ForwardBatch.build(contexts, [1, 1, 1], sample)
        expected = model(x, built, pool)
        graphs = DecodeGraphs(model, twin, torch.device("cpu"), first=not downstream, max_rows=8)
        assert graphs.takes([1, 1, 1], [len(c) for c in contexts])
        batch = graphs.batch(contexts, sample)
        assert graphs.owns(batch) and batch.num_tokens == 3
        assert batch.sample_rows.tolist() == [0, 2]
        ids = x.tolist() if not downstream else None
        got = graphs.forward(ids, None if ids is not None else x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    new = torch.tensor([c[-1] for c in contexts])
    for j in range(len(layers)):  # the new tokens' K/V, where the pass put them
        torch.testing.assert_close(twin.k[j][new], pool.k[j][new], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(twin.v[j][new], pool.v[j][new], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(CAPACITY, dtype=torch.bool)
    untouched[new] = False
    untouched[0] = False  # the padding row's slot
    for j in range(len(layers)):
        assert torch.equal(twin.k[j][untouched], pool.k[j][untouched])


def test_only_decode_passes_that_fit_take_the_static_path(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    _, model, pool = prefilled(model_dir, range(cfg.num_layers), [[1, 2, 3]])
    graphs = DecodeGraphs(model, pool, torch.device("cpu"), first=True, max_rows=4)
    assert graphs.takes([1] * 4, [10] * 4)
    assert not graphs.takes([1, 2], [10, 10])  # a prefill chunk
    assert not graphs.takes([], [])  # nothing to decode
    assert not graphs.takes([1] * 5, [10] * 5)  # more rows than the largest bucket
    assert not graphs.takes([1], [CAPACITY + 1])  # wider than the pool
    with pytest.raises(RuntimeError, match="after its batch was written"):
        graphs.forward([1], None)


def test_a_wider_pass_than_any_before_grows_the_buffers_and_still_computes_the_same(model_dir):
    """The index buffers hold the widest context seen so far: a first pass
    of one short context sizes them for 256 tokens, the next, with a
    300-token context, grows them (on a GPU, dropping the graphs that read
    the old ones)."""
    slots = random.Random(1).sample(range(1, CAPACITY), 320)
    short, long = slots[:20], slots[20:]
    cfg = ModelConfig.from_dir(model_dir)
    layers = range(cfg.num_layers)
    _, model, pool = prefilled(model_dir, layers, [short[:-1], long])
    twin = KVPool(len(layers), CAPACITY, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    for j in range(len(layers)):
        twin.k[j].copy_(pool.k[j])
        twin.v[j].copy_(pool.v[j])
    graphs = DecodeGraphs(model, twin, torch.device("cpu"), first=True, max_rows=4)
    widths = []
    with torch.inference_mode():
        for step in ([short[:-1]], [short, long]):
            ids = [5, 7][: len(step)]
            built = ForwardBatch.build(step, [1] * len(step), [True] * len(step))
            expected = model(torch.tensor(ids), built, pool)
            graphs.batch(step, [True] * len(step))
            widths.append(graphs._width)
            got = graphs.forward(ids, None)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert widths == [256, 512]


def test_a_bucket_whose_capture_fails_runs_op_by_op_and_is_not_captured_again(model_dir):
    """A capture that raises (a GPU out of memory, say) leaves its bucket to
    run op by op, the same pass computed, and is not tried again."""
    slots = random.Random(2).sample(range(1, CAPACITY), 40)
    contexts = [slots[:20], slots[20:]]
    cfg = ModelConfig.from_dir(model_dir)
    _, model, pool = prefilled(model_dir, range(cfg.num_layers), contexts)
    graphs = DecodeGraphs(model, pool, torch.device("cpu"), first=True, max_rows=4)
    graphs.captures = True  # as on a GPU, with a capture that cannot succeed
    tried = []

    def failing(rows: int, width: int) -> None:
        tried.append((rows, width))
        raise RuntimeError("CUDA out of memory")

    graphs._capture = failing
    with torch.inference_mode():
        expected = model(
            torch.tensor([3, 4]), ForwardBatch.build(contexts, [1, 1], [True, True]), pool
        )
        for _ in range(2):
            graphs.batch(contexts, [True, True])
            got = graphs.forward([3, 4], None)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert tried == [(2, 256)] and graphs.replays == 0
