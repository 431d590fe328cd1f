"""Sizing a ring before any rank allocates: the layer split and the one KV
capacity, from the memory planner when rank budgets are given (DESIGN §5),
and each rank's check of what it allocated against its ledger row."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog
import torch

from ringserve.engine.boot import EngineConfig, resolve_dtype
from ringserve.engine.plan import Plan, plan
from ringserve.engine.runner import Runner
from ringserve.models.config import ModelConfig

log = structlog.get_logger(__name__)


def size_ring(
    config: EngineConfig, pp_size: int, rank_memory_mib: list[int] | str | None
) -> tuple[EngineConfig, Plan | None]:
    """The config every rank is started with. The planner picks the split
    and the capacity from the given budgets, or, when neither budgets nor a
    split are given, from each rank's default budget (free device memory on
    CUDA, a share of available RAM on the CPU) with the capacity capped at
    `kv_capacity_tokens`, so a roomy machine does not reserve more KV than
    the server is configured for. A given split is used as it is."""
    cfg = ModelConfig.from_dir(config.model_dir)
    if config.layer_split is not None:
        if rank_memory_mib is not None:
            raise ValueError("give rank memory budgets or a layer split, not both: the planner picks the split")
        check_split(config.layer_split, pp_size, cfg.num_layers)
        return config, None
    cap = None if rank_memory_mib is not None else config.kv_capacity_tokens
    solved = plan(
        config.model_dir,
        pp_size=pp_size,
        rank_memory_mib=rank_memory_mib,
        max_num_tokens_per_pass=config.max_tokens_per_pass,
        max_num_seqs=config.max_batch,
        dtype=resolve_dtype(config.dtype, cfg),
        max_capacity_tokens=cap,
    )
    sized = replace(
        config,
        layer_split=tuple(solved.layer_split),
        kv_capacity_tokens=solved.capacity_tokens,
        plan=solved.to_dict(),
    )
    return sized, solved


def check_split(split: tuple[int, ...] | list[int], pp_size: int, num_layers: int) -> None:
    if len(split) != pp_size or sum(split) != num_layers or min(split) < 1:
        raise ValueError(
            f"layer_split {list(split)} must give {pp_size} ranks >= 1 layer each, "
            f"{num_layers} layers in all"
        )


def measure_activations(runner: Runner, tokens: int, rows: int) -> int:
    """Activation peak of a dry forward at the largest pass, in bytes: the
    device's peak allocation on CUDA, the rise of the resident-set high-water
    mark on the CPU (reset first through /proc/self/clear_refs)."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
        runner.dry_run(tokens, rows)
        return torch.cuda.max_memory_allocated(runner.device) - before
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    runner.dry_run(tokens, rows)
    return max(0, _status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def check_allocation(
    plan_dict: dict[str, Any] | None, rank: int, runner: Runner, tokens: int, rows: int
) -> None:
    """Log what this rank allocated, and the activation peak it measured,
    against its ledger row; anything beyond the plan is reported as
    unforeseen."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes = runner.pool.nbytes
    try:
        activations = measure_activations(runner, tokens, rows)
    except OSError as exc:  # no /proc: say so rather than report a made-up 0
        log.warning("plan.activations_unmeasured", rank=rank, reason=str(exc))
        activations = None
    if plan_dict is None:
        log.info("plan.allocated", rank=rank, weights=weights, kv=kv_bytes, activations=activations, planned=False)
        return
    row = plan_dict["ranks"][rank]
    planned = {k: row[k]["bytes"] for k in ("weights", "kv", "activations")}
    actual = {"weights": weights, "kv": kv_bytes}
    if activations is not None:
        actual["activations"] = activations
    log.info("plan.allocated", rank=rank, planned=planned, actual=actual)
    for part, nbytes in actual.items():
        if nbytes > planned[part]:
            log.warning("plan.unforeseen", rank=rank, part=part, planned=planned[part], actual=nbytes)
