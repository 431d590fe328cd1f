"""Where ranks run: the `device` option's words, the one placement rule
that the planner's budgets and the ranks both follow, and its resolution
before any rank starts."""

from __future__ import annotations

import pytest
import torch

from ringserve.config import EngineConfig, rank_device
from ringserve.models.builtin import builtin_model_dir
from ringserve.plan.ledger import default_budgets
from ringserve.plan.sizing import resolve_device, size_ring

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:3", "cpu,cuda:0,cuda"])
def test_engine_config_takes_every_device_word(device):
    assert EngineConfig(model_dir=builtin_model_dir(), device=device).device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "auto,cpu", "cpu,,cuda", "mps"])
def test_engine_config_refuses_a_device_it_does_not_know(device):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda"):
        EngineConfig(model_dir=builtin_model_dir(), device=device)


def test_cuda_puts_rank_r_on_gpu_r_modulo_the_gpus():
    assert [rank_device("cuda", r, 2) for r in range(5)] == [f"cuda:{i}" for i in (0, 1, 0, 1, 0)]
    assert [rank_device("cuda", r, 1) for r in range(3)] == ["cuda:0"] * 3
    with pytest.raises(ValueError, match="no CUDA device"):
        rank_device("cuda", 0, 0)


def test_auto_is_the_gpus_where_there_are_some_and_the_cpu_elsewhere():
    assert [rank_device("auto", r, 0) for r in range(3)] == ["cpu"] * 3
    assert [rank_device("auto", r, 2) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]


def test_a_per_rank_list_names_each_ranks_device():
    placed = [rank_device("cuda:1,cpu,cuda", r, 2) for r in range(3)]
    assert placed == ["cuda:1", "cpu", "cuda:0"]


def test_resolution_checks_the_list_against_the_ring():
    with pytest.raises(ValueError, match="2 devices given for 3 ranks"):
        resolve_device("cpu,cpu", 3)
    assert resolve_device("cpu,cpu,cpu", 3) == "cpu,cpu,cpu"


@NO_GPU
def test_without_a_gpu_auto_resolves_to_the_cpu_and_cuda_is_refused():
    assert resolve_device("auto", 2) == "cpu"
    for device in ("cuda", "cpu,cuda:0"):
        with pytest.raises(ValueError, match="asks for CUDA, but torch sees no GPU"):
            resolve_device(device, 2)


def test_the_sized_config_carries_the_resolved_device_to_every_rank():
    config = EngineConfig(model_dir=builtin_model_dir(), device="auto", layer_split=(2, 2))
    sized, _ = size_ring(config, 2, None)
    assert sized.device == ("cuda" if torch.cuda.is_available() else "cpu")
    sized, plan = size_ring(EngineConfig(model_dir=builtin_model_dir(), device="cpu"), 2, None)
    assert sized.device == "cpu" and plan is not None


def test_cpu_ranks_share_the_cpus_budget_equally():
    one, two = default_budgets(1, "cpu"), default_budgets(2, "cpu")
    assert len(two) == 2 and two[0].bytes == two[1].bytes > 0
    assert all(f.source == "measured" for f in one + two)
    # the same memory, halved (MemAvailable may move a little between the reads)
    assert two[0].bytes == pytest.approx(one[0].bytes / 2, rel=0.05)
