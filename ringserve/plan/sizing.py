"""Sizing a ring before any rank allocates: the layer split and the one KV
capacity, from the memory planner when rank budgets are given (DESIGN §5)."""

from __future__ import annotations

from dataclasses import replace

import structlog

from ringserve.config import EngineConfig, device_list, rank_device, resolve_dtype
from ringserve.models.config import ModelConfig
from ringserve.plan.draft import draft_config
from ringserve.plan.host import solve_host, with_host
from ringserve.plan.ledger import GIB, PlanError, mem_available, visible_gpus
from ringserve.plan.solve import Objective, Plan, plan

log = structlog.get_logger(__name__)


def size_ring(
    config: EngineConfig,
    pp_size: int,
    rank_memory_mib: list[int] | str | None,
    measured: list[int] | None = None,
) -> tuple[EngineConfig, Plan | None]:
    """The config every rank is started with. The planner picks the split
    and the capacity from the given budgets, or, when neither budgets nor a
    split are given, from each rank's default budget (free device memory on
    CUDA, a share of available RAM on the CPU) with the capacity capped at
    `kv_capacity_tokens`, so a roomy machine does not reserve more KV than
    the server is configured for. The split trades capacity for a faster
    slowest stage as `plan_for` says, with `rank_speed` the planned speeds.
    A given split is used as it is. The device is resolved here, once, for
    every rank (`resolve_device`). `measured`: the default budgets as each
    rank's own node measured them (a ring of several nodes), used as this
    machine's own measurements would be."""
    config = replace(config, device=resolve_device(config.device, pp_size))
    cfg = ModelConfig.from_dir(config.model_dir)
    if config.speculative == "draft" and config.draft_model is not None:
        draft_config(config.draft_model, cfg)  # before any rank loads either
    if config.layer_split is not None:
        if rank_memory_mib is not None:
            raise ValueError(
                "give rank memory budgets or a layer split, not both: the planner picks the split"
            )
        check_split(config.layer_split, pp_size, cfg.num_layers)
        tokens, _ = solve_host(config, cfg, resolve_dtype(config.dtype, cfg.torch_dtype))
        return replace(config, host_kv_tokens=tokens, host_kv_mib=None), None
    if config.rank_speed is not None and len(config.rank_speed) != pp_size:
        raise ValueError(f"{len(config.rank_speed)} rank speeds for pp_size {pp_size}")
    cap = None if rank_memory_mib is not None else config.kv_capacity_tokens
    solved_dtype = resolve_dtype(config.dtype, cfg.torch_dtype)
    solved = plan(
        config.model_dir,
        pp_size=pp_size,
        rank_memory_mib=rank_memory_mib,
        max_num_tokens_per_pass=config.max_tokens_per_pass,
        max_num_seqs=config.max_batch,
        dtype=solved_dtype,
        max_capacity_tokens=cap,
        objective=Objective(config.plan_for, config.rank_speed, config.min_kv_tokens),
        draft_model=config.draft_model if config.speculative == "draft" else None,
        device=config.device,
        measured=measured if rank_memory_mib is None else None,
    )
    split = tuple(solved.layer_split)
    host_tokens, host = solve_host(replace(config, layer_split=split), cfg, solved_dtype)
    solved = with_host(solved, host_tokens, host)
    sized = replace(
        config,
        layer_split=split,
        kv_capacity_tokens=solved.capacity_tokens,
        host_kv_tokens=host_tokens,
        host_kv_mib=None,
        plan=solved.to_dict(),
    )
    return sized, solved


def resolve_device(device: str, pp_size: int) -> str:
    """`device` as every rank is started with it: `auto` becomes `cuda`
    where torch sees a GPU and `cpu` elsewhere; a per-rank list must name
    one device per rank; a CUDA device that is not there is refused here,
    before any rank starts."""
    parts = device_list(device)
    if len(parts) > 1 and len(parts) != pp_size:
        raise ValueError(f"{len(parts)} devices given for {pp_size} ranks: give one per rank")
    count = visible_gpus()
    if device == "auto":
        return "cuda" if count else "cpu"
    for part in parts:
        if part.startswith("cuda") and count == 0:
            raise ValueError(f"device {device!r} asks for CUDA, but torch sees no GPU here")
        index = part.partition(":")[2]
        if index and int(index) >= count:
            raise ValueError(f"device {part} is not there: torch sees {count} GPU(s)")
    return device


def check_fits_here(config: EngineConfig, plan: Plan | None) -> None:
    """Refuse, before any rank starts, a plan whose ranks on this machine's
    CPU need more of its memory than is available (budgets written for
    GPUs, say): the kernel would kill a rank for it mid-boot, and the
    launcher could only say the rank was killed. Host KV tiers count too,
    on any device. For a ring on this machine alone (several nodes each
    hold only their own ranks)."""
    if plan is None:
        return
    places = placement(config.device, len(plan.ledger))
    ranks = sum(row.needs for row, place in zip(plan.ledger, places, strict=True) if place == "cpu")
    host = sum(row.host.bytes for row in plan.ledger if row.host is not None)
    need = ranks + host
    if not need:
        return
    available = mem_available()
    if need > available:
        # the advice names what takes the most of it
        fix = (
            "give a smaller host KV tier (--host-kv-tokens, --host-kv-mib)"
            if host > ranks
            else "give smaller --rank-memory-mib budgets (or none: then they are measured)"
        )
        raise PlanError(
            f"the plan needs {need / GIB:.1f} GiB of this machine's memory (weights, KV pools "
            f"and activations of its ranks on the CPU, and host KV tiers) but "
            f"{available / GIB:.1f} GiB is available: a rank would be killed for memory; {fix}"
        )


def placement(device: str, pp_size: int) -> list[str]:
    """Where each rank of the ring runs (`config.rank_device` with this
    machine's GPUs), for the plan's printout."""
    count = visible_gpus()
    return [rank_device(device, r, count) for r in range(pp_size)]


def check_split(split: tuple[int, ...] | list[int], pp_size: int, num_layers: int) -> None:
    if len(split) != pp_size or sum(split) != num_layers or min(split) < 1:
        raise ValueError(
            f"layer_split {list(split)} must give {pp_size} ranks >= 1 layer each, "
            f"{num_layers} layers in all"
        )
