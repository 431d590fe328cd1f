"""The planner's activation figure covers what a rank's forward really
holds at its peak: for every model family, dtype and CPU kernel choice, the
exact peak of the boot's dry forward (torch's allocator, `measure_peak`) at
the largest pass stays within `estimate_activations`, on a first rank and
on a last one (logits), and the figure is not so loose that it means
nothing."""

from __future__ import annotations

import pytest

from ringserve.config import EngineConfig
from ringserve.launch.boot import build_stage
from ringserve.models.config import ModelConfig
from ringserve.plan.audit import measure_activations
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
