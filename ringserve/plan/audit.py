"""Each rank's boot-time audit: what it allocated, and the activation peak it
measured with a dry forward, against its ledger row (DESIGN §5: no
allocation made after the plan may be missing from it). The dry forward is
timed too: its ms per layer is logged beside the speed the plan assumed, a
report against the prediction, not an input to it (planning is done before
any rank starts). Injected `slow` faults are not in it: they act on passes."""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from ringserve.engine.drafter import Drafter
from ringserve.engine.runner import Runner

log = structlog.get_logger(__name__)


def measure_activations(runner: Runner, tokens: int, rows: int) -> int:
    """Activation peak of a dry forward at the largest pass, in bytes: the
    device's peak allocation on CUDA, the rise of the resident-set high-water
    mark on the CPU (see `measure_peak`)."""
    return measure_peak(runner.device, lambda: runner.dry_run(tokens, rows))


def measure_peak(device: torch.device, run: Callable[[], None]) -> int:
    """The bytes `run` takes at its peak beyond what was allocated before.

    On the CPU the figure is the rise of the resident set's high-water mark
    (reset through /proc/self/clear_refs). A first run also pays one-time
    costs (thread pools, allocator arenas) that are no activations, and
    memory the C allocator kept from earlier frees hides a rise: so `run`
    runs once unmeasured, and freed memory goes back to the system
    (`malloc_trim`, where the C library has it) before the measured run.
    Python's cyclic garbage is collected first and the collector is off
    while the measured run lasts: a collection in it would free memory that
    earlier code left behind and the run would reuse it, hiding part of its
    peak. Measured so, the figure repeats within a few percent."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        return torch.cuda.max_memory_allocated(device) - before
    run()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        _trim_heap()
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        run()
        return max(0, _status_kib("VmHWM") - before) * 1024
    finally:
        if enabled:
            gc.enable()


def _trim_heap() -> None:
    """Hand the C allocator's free memory back to the system (glibc only)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_ms_per_layer(runner: Runner, tokens: int, rows: int) -> float:
    """Wall time of one dry forward at the largest pass (the first has
    already run, so no warm-up is in it), per layer this rank holds; on the
    last rank it includes the logits."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    start = time.perf_counter()
    runner.dry_run(tokens, rows)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return (time.perf_counter() - start) * 1e3 / len(runner.layers)


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
        log.info(
            "plan.allocated",
            rank=rank,
            weights=weights,
            kv=kv_bytes,
            activations=activations,
            planned=False,
        )
        return
    row = plan_dict["ranks"][rank]
    _report_speed(row, rank, measure_ms_per_layer(runner, tokens, rows))
    planned = {k: row[k]["bytes"] for k in ("weights", "kv", "activations")}
    actual = {"weights": weights, "kv": kv_bytes}
    if activations is not None:
        actual["activations"] = confirmed(
            activations, planned["activations"], lambda: measure_activations(runner, tokens, rows)
        )
    host = runner.host.nbytes if runner.host is not None else 0
    if host or "host_kv" in row:  # host memory: its own column, outside the budget
        planned["host_kv"] = row.get("host_kv", {"bytes": 0})["bytes"]
        actual["host_kv"] = host
    log.info("plan.allocated", rank=rank, planned=planned, actual=actual)
    _report_unforeseen(rank, planned, actual)


def check_draft(plan_dict: dict[str, Any] | None, drafter: Drafter, tokens: int, rows: int) -> None:
    """Log what rank 0's draft model allocated (weights, KV pool) and the
    activation peak of a dry draft forward at the largest pass, against the
    draft entry of rank 0's ledger row, as check_allocation does for the
    target: a draft the plan left out is unforeseen in every part."""
    weights = sum(p.numel() * p.element_size() for p in drafter.model.parameters())
    actual = {"draft_weights": weights, "draft_kv": drafter.pool.nbytes}

    def measure() -> int:
        return measure_peak(drafter.device, lambda: drafter.dry_run(tokens, rows))

    try:
        actual["draft_activations"] = measure()
    except OSError as exc:
        log.warning("plan.activations_unmeasured", rank=0, part="draft", reason=str(exc))
    if plan_dict is None:
        log.info("plan.allocated", rank=0, planned=False, actual=actual)
        return
    entry = plan_dict["ranks"][0].get("draft", {})
    planned = {f"draft_{k}": entry.get(k, {"bytes": 0})["bytes"] for k in _DRAFT_PARTS}
    if "draft_activations" in actual:
        actual["draft_activations"] = confirmed(
            actual["draft_activations"], planned["draft_activations"], measure
        )
    log.info("plan.allocated", rank=0, planned=planned, actual=actual)
    _report_unforeseen(0, planned, actual)


_DRAFT_PARTS = ("weights", "kv", "activations")


def confirmed(measured: int, planned: int, again: Callable[[], int]) -> int:
    """An activation peak above the plan, measured once more; the smaller
    figure stands. On the CPU a peak is a resident-set rise, which any other
    allocation in the process during the run inflates (a page or an
    allocator arena: a sizeable share of a tiny model's activations), so a
    single high reading is not yet a shortfall of the plan."""
    return min(measured, again()) if measured > planned else measured


def _report_unforeseen(rank: int, planned: dict[str, int], actual: dict[str, int]) -> None:
    for part, nbytes in actual.items():
        if nbytes > planned[part]:
            log.warning(
                "plan.unforeseen", rank=rank, part=part, planned=planned[part], actual=nbytes
            )


def _report_speed(row: dict[str, Any], rank: int, ms_per_layer: float) -> None:
    """`reference_ms_per_layer` is the measured time scaled by the planned
    speed: where the speeds given were right, every rank logs about the
    same figure, and its stage takes stage_time of them."""
    log.info(
        "plan.speed",
        rank=rank,
        layers=row["layers"][1] - row["layers"][0],
        ms_per_layer=round(ms_per_layer, 3),
        planned_speed=row["speed"],
        planned_stage_time=row["stage_time"],
        reference_ms_per_layer=round(ms_per_layer * row["speed"], 3),
    )
