"""ringserve's models against transformers on the same random-weight
checkpoints: batched prefill, extension over a paged cached prefix, and a
model split into stages."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve.cache.pool import KVPool
from ringserve.kernels import ops
from ringserve.kernels.batch import ForwardBatch
from ringserve.models import ModelSlice, build_model
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model
from tests import model_factory

FAMILIES = {
    "llama_gqa": model_factory.llama_gqa,
    "llama_gqa_llama3": partial(model_factory.llama_gqa, rope_scaling=True),
    "qwen2_tied": model_factory.qwen2_tied,
    "qwen3_qknorm": model_factory.qwen3_qknorm,
    "bigcode_mqa": model_factory.bigcode_mqa,
}
CAPACITY = 1024
ATOL = 1e-4


@dataclass
class Family:
    path: Path
    cfg: ModelConfig
    hf: torch.nn.Module
    ours: ModelSlice


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    path = FAMILIES[request.param](tmp_path_factory.mktemp("models"))
    cfg = ModelConfig.from_dir(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, cfg, range(cfg.num_layers), torch.float32)
    return Family(path, cfg, hf, ours)


def scattered_rows(lens: list[int], seed: int) -> list[list[int]]:
    """Disjoint slot lists in random order over the pool (never slot 0)."""
    perm = (
        torch.randperm(CAPACITY - 1, generator=torch.Generator().manual_seed(seed)) + 1
    ).tolist()
    rows, start = [], 0
    for n in lens:
        rows.append(perm[start : start + n])
        start += n
    return rows


def random_tokens(cfg: ModelConfig, lens: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]


def pool_for(model: ModelSlice) -> KVPool:
    cfg = model.cfg
    return KVPool(len(model.layer_range), CAPACITY, cfg.num_kv_heads, cfg.head_dim, model.dtype)


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return hf(tokens[None]).logits[0].float()


@torch.no_grad()
def run_pass(
    stages: list[tuple[ModelSlice, KVPool]],
    tokens: list[torch.Tensor],
    rows: list[list[int]],
    extend: list[int],
) -> torch.Tensor:
    """One pass of new tokens (the last extend[b] of sequence b) through the
    stages in order; logits of every new token."""
    batch = ForwardBatch.build(rows, extend, [True] * len(rows))
    x = torch.cat([t[len(t) - e :] for t, e in zip(tokens, extend, strict=True)])
    for model, pool in stages:
        x = model(x, batch, pool)
    return stages[-1][0].logits(x)


def test_batched_prefill_of_uneven_sequences_matches_transformers(family: Family) -> None:
    lens = [5, 17, 1, 40]
    tokens = random_tokens(family.cfg, lens, seed=1)
    logits = run_pass([(family.ours, pool_for(family.ours))], tokens, scattered_rows(lens, 1), lens)
    expected = torch.cat([hf_logits(family.hf, t) for t in tokens])
    assert logits.dtype == torch.float32
    assert logits.shape == (sum(lens), family.cfg.vocab_size)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-5)


def test_extension_over_scattered_cached_prefix_matches_transformers(family: Family) -> None:
    # A long prefix (past llama3's original context of 256), a chunked
    # prefill and a decode step share the second pass.
    lens, prefix = [300, 12, 8], [280, 5, 7]
    tokens = random_tokens(family.cfg, lens, seed=2)
    rows = scattered_rows(lens, 2)
    pool = pool_for(family.ours)
    stages = [(family.ours, pool)]
    run_pass(
        stages,
        [t[:p] for t, p in zip(tokens, prefix, strict=True)],
        [r[:p] for r, p in zip(rows, prefix, strict=True)],
        prefix,
    )
    extend = [n - p for n, p in zip(lens, prefix, strict=True)]
    logits = run_pass(stages, tokens, rows, extend)
    expected = torch.cat([hf_logits(family.hf, t)[p:] for t, p in zip(tokens, prefix, strict=True)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-5)


def test_decode_steps_after_prefill_match_transformers(family: Family) -> None:
    lens, steps = [9, 3], 3
    tokens = random_tokens(family.cfg, [n + steps for n in lens], seed=3)
    rows = scattered_rows([n + steps for n in lens], 3)
    full = [hf_logits(family.hf, t) for t in tokens]
    stages = [(family.ours, pool_for(family.ours))]
    for step in range(steps + 1):
        now = [n + step for n in lens]
        extend = lens if step == 0 else [1] * len(lens)
        logits = run_pass(
            stages,
            [t[:n] for t, n in zip(tokens, now, strict=True)],
            [r[:n] for r, n in zip(rows, now, strict=True)],
            extend,
        )
        expected = torch.cat([f[n - e : n] for f, n, e in zip(full, now, extend, strict=True)])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-5, msg=f"step {step}")


def test_forward_through_the_triton_kernels_equals_the_reference_path(family: Family) -> None:
    # The switch picks Triton for CUDA tensors only; forcing it sends these
    # CPU tensors to the kernels under the interpreter (conftest sets it).
    lens = [9, 4]
    tokens = random_tokens(family.cfg, lens, seed=6)
    rows = scattered_rows([n + 1 for n in lens], 6)
    results = []
    for triton in (False, True):
        with mock.patch.object(ops, "uses_triton", lambda device, on=triton: on):
            pool = pool_for(family.ours)
            prefill = run_pass([(family.ours, pool)], tokens, [r[:-1] for r in rows], lens)
            nxt = [torch.cat([t, t[:1]]) for t in tokens]
            decode = run_pass([(family.ours, pool)], nxt, rows, [1, 1])
        results.append(torch.cat([prefill, decode]))
    torch.testing.assert_close(results[1], results[0], atol=ATOL, rtol=1e-5)


def test_two_stage_split_equals_whole_model_at_every_boundary(family: Family) -> None:
    cfg, lens = family.cfg, [6, 23]
    tokens = random_tokens(cfg, lens, seed=4)
    rows = scattered_rows(lens, 4)
    whole = run_pass([(family.ours, pool_for(family.ours))], tokens, rows, lens)
    for k in range(1, cfg.num_layers):
        front = load_model(family.path, cfg, range(0, k), torch.float32)
        back = load_model(family.path, cfg, range(k, cfg.num_layers), torch.float32)
        split = run_pass([(front, pool_for(front)), (back, pool_for(back))], tokens, rows, lens)
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=0, msg=f"split at layer {k}")


def test_bfloat16_model_is_as_accurate_as_transformers_in_bfloat16(family: Family) -> None:
    cfg, lens = family.cfg, [7, 30]
    tokens = random_tokens(cfg, lens, seed=5)
    ours = load_model(family.path, cfg, range(cfg.num_layers), torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(family.path, dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    logits = run_pass([(ours, pool_for(ours))], tokens, scattered_rows(lens, 5), lens)
    exact = torch.cat([hf_logits(family.hf, t) for t in tokens])
    ours_err = (logits - exact).abs()
    ref_err = (torch.cat([hf_logits(hf, t) for t in tokens]) - exact).abs()
    # Rounding differs in detail (batching, fused matmuls), not in size.
    assert ours_err.mean() <= 1.25 * ref_err.mean()
    assert ours_err.max() <= 1.25 * ref_err.max() + 0.05


def test_forward_rejects_a_pool_with_the_wrong_layer_count(family: Family) -> None:
    cfg = family.cfg
    pool = KVPool(cfg.num_layers + 1, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    batch = ForwardBatch.build([[1, 2]], [2], [True])
    with pytest.raises(ValueError, match="KV pool has"):
        family.ours(torch.tensor([1, 2]), batch, pool)


def test_build_model_picks_the_class_by_family(family: Family) -> None:
    model = build_model(family.cfg, range(0, 1), torch.float32)
    expected = "GPTBigCodeModel" if family.cfg.family == "gpt_bigcode" else "LlamaModel"
    assert type(model).__name__ == expected
    assert model.is_first and not model.is_last
    with pytest.raises(RuntimeError, match="not the last stage"):
        model.logits(torch.zeros(1, family.cfg.hidden_size))


def test_layer_range_outside_the_model_is_refused() -> None:
    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 16,
            "hidden_size": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 16,
        }
    )
    for bad in (range(0, 3), range(1, 1), range(0, 2, 2)):
        with pytest.raises(ValueError, match="layer range"):
            build_model(cfg, bad, torch.float32)
