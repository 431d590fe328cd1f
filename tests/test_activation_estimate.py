"""The planner's activation figure covers what a rank's forward really
holds at its peak: for every model family, dtype and CPU kernel choice, the
exact peak of the boot's dry forward (torch's allocator, `measure_peak`) at
the largest pass stays within `estimate_activations`, on a first rank and
on a last one (logits), and the figure is not so loose that it means
nothing."""

from __future__ import annotations

import pytest
import torch

from ringserve.config import EngineConfig
from ringserve.kernels.batch import ForwardBatch
from ringserve.launch.boot import build_stage
from ringserve.models.config import ModelConfig
from ringserve.plan.audit import measure_activations, measure_peak
from ringserve.plan.ledger import estimate_activations
from tests import model_factory

FAMILIES = ["llama_gqa", "qwen3_qknorm", "qwen2_tied", "bigcode_mqa"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families")
    return {name: getattr(model_factory, name)(tmp / name) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_the_dry_forward_peak_stays_within_the_estimate(models, family, dtype, kernels):
    path = models[family]
    cfg = ModelConfig.from_dir(path)
    split = (cfg.num_layers // 2, cfg.num_layers - cfg.num_layers // 2)
    for tokens, rows in [(64, 16), (48, 48), (256, 8)]:
        config = EngineConfig(
            model_dir=str(path),
            dtype=dtype,
            cpu_kernels=kernels,
            max_tokens_per_pass=tokens,
            max_batch=rows,
            kv_capacity_tokens=1024,
            layer_split=split,
        )
        for rank, layers in [(0, range(split[0])), (1, range(split[0], cfg.num_layers))]:
            runner = build_stage(config, cfg, layers, rank).runner
            peak = measure_activations(runner, tokens, rows)
            estimate = estimate_activations(
                cfg, dtype, rank=rank, pp_size=2, max_num_tokens_per_pass=tokens,
                max_num_seqs=rows,
            ).bytes  # fmt: skip
            shape = f"{family} {dtype} {kernels} rank {rank}, {tokens} tokens in {rows} rows"
            assert peak <= estimate, f"{shape}: peak {peak} over the estimate {estimate}"
            assert peak >= estimate // 4, f"{shape}: peak {peak}, estimate {estimate}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_contexts_stay_within_the_estimate_too(models, family, dtype):
    # contexts 15x the pass: attention through torch copies contexts out of
    # the pool, and must not copy them whole (attention_bounded.py)
    path = models[family]
    cfg = ModelConfig.from_dir(path)
    tokens, rows = 64, 4
    config = EngineConfig(
        model_dir=str(path),
        dtype=dtype,
        cpu_kernels="torch",
        max_tokens_per_pass=tokens,
        max_batch=rows,
        kv_capacity_tokens=4096,
        layer_split=(cfg.num_layers - 1, 1),
    )
    runner = build_stage(config, cfg, range(cfg.num_layers - 1), 0).runner
    context = 15 * tokens  # within the models' 1024 positions
    slots = [list(range(1 + r * context, 1 + (r + 1) * context)) for r in range(rows)]
    news = [tokens - rows + 1, 1, 1, 1]  # one chunk of a long prompt, three decoding
    batch = ForwardBatch.build(slots, news, [True] * rows, runner.device, None, tokens)
    ids = torch.zeros(sum(news), dtype=torch.int64)

    def run() -> None:
        with torch.inference_mode():
            runner.model(ids, batch, runner.pool)

    peak = measure_peak(runner.device, run)
    estimate = estimate_activations(
        cfg, dtype, rank=0, pp_size=2, max_num_tokens_per_pass=tokens, max_num_seqs=rows
    ).bytes
    assert peak <= estimate, f"{family} {dtype}: peak {peak} over the estimate {estimate}"
