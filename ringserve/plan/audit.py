"""Each rank's boot-time audit: what it allocated, and the activation peak it
measured with a dry forward, against its ledger row (DESIGN §5: no
allocation made after the plan may be missing from it). The dry forward is
timed too: its ms per layer is logged beside the speed the plan assumed, a
report against the prediction, not an input to it (planning is done before
any rank starts). Injected `slow` faults are not in it: they act on passes."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler import profile

from ringserve.engine.drafter import Drafter
from ringserve.engine.runner import Runner

log = structlog.get_logger(__name__)


def measure_activations(part: Runner | Drafter, tokens: int, rows: int) -> int:
    """Activation peak of a dry forward of the rank's slice or of rank 0's
    draft model at the largest pass, in bytes (see `measure_peak`)."""
    return measure_peak(part.device, lambda: part.dry_run(tokens, rows))


def measure_peak(device: torch.device, run: Callable[[], None]) -> int:
    """The bytes of tensor memory `run` holds at its peak beyond what was
    allocated before: the caching allocator's peak on CUDA; on the CPU the
    peak of the running sum of the allocations and frees torch's CPU
    allocator reports to its profiler while `run` lasts (what oneDNN takes
    through torch included; a block from before the run is freed unseen,
    the allocator knows no size for it, so it cannot lower the figure).
    Exact and repeatable, where a resident-set rise is not: the C heap's
    placement of the same blocks moves that by tens of pages a run.

    Tensors a first run creates and keeps (caches) count, as they do on
    CUDA: they are memory the plan must cover. Python's cyclic garbage is
    collected first and the collector is off while `run` lasts: a
    collection inside it would free tensors that earlier code left behind,
    and their frees would hide part of the peak."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            run()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before
        with _kineto_banner_dropped(), profile(profile_memory=True) as prof:
            run()
        return peak_of(
            (event.start_ns(), event.nbytes())
            for event in prof.kineto_results.events()
            if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
        )
    finally:
        if enabled:
            gc.enable()


def peak_of(changes: Iterable[tuple[int, int]]) -> int:
    """The highest running sum of (time, bytes) allocations (bytes > 0) and
    frees (bytes < 0) taken in time order, from 0: what was live before is
    not counted. A free counts only against a block of its size the run
    took: a block from before the run is not the run's, whether the
    allocator reports no size for it or a stale one (it keeps the size of an
    address it saw allocated in an earlier profile and freed outside it, and
    reports that size when a later block at the same address goes: read
    once as 5 MiB for a run that held 6). Within one instant allocations go
    before frees, so a peak is never read low."""
    live = peak = 0
    taken: Counter[int] = Counter()
    for _, nbytes in sorted(changes, key=lambda c: (c[0], -c[1])):
        if nbytes < 0:
            if not taken[-nbytes]:
                continue
            taken[-nbytes] -= 1
        else:
            taken[nbytes] += 1
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _kineto_banner_dropped() -> Iterator[None]:
    """Run the block with the process's stderr caught in a file, then write
    back everything but the lines the profiler's C++ side prints at each
    start and stop (`_banner`; no setting silences them): a rank's boot log
    stays clean and no other line written meanwhile, by any thread, is
    lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(True) if not _banner(line)]
            if kept:
                os.write(2, b"".join(kept))


def _banner(line: bytes) -> bool:
    """The profiler's start and stop lines, and its complaint, harmless
    (measured: the same figures), when it starts on a thread other than the
    one that imported torch, as rank 0's does inside an `LLM`."""
    if line.startswith(b"USDT:"):
        return b"SyncActivityProfilerHandler" in line
    return line.startswith(b"ERROR: External init callback must run in same thread")


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


def check_allocation(
    plan_dict: dict[str, Any] | None, rank: int, runner: Runner, tokens: int, rows: int
) -> None:
    """Log what this rank allocated, and the activation peak it measured,
    against its ledger row; anything beyond the plan is reported as
    unforeseen."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes = runner.pool.nbytes
    activations = measure_activations(runner, tokens, rows)
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
    actual = {"weights": weights, "kv": kv_bytes, "activations": activations}
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
    actual = {
        "draft_weights": weights,
        "draft_kv": drafter.pool.nbytes,
        "draft_activations": measure_activations(drafter, tokens, rows),
    }
    if plan_dict is None:
        log.info("plan.allocated", rank=0, planned=False, actual=actual)
        return
    entry = plan_dict["ranks"][0].get("draft", {})
    planned = {f"draft_{k}": entry.get(k, {"bytes": 0})["bytes"] for k in _DRAFT_PARTS}
    log.info("plan.allocated", rank=0, planned=planned, actual=actual)
    _report_unforeseen(0, planned, actual)


_DRAFT_PARTS = ("weights", "kv", "activations")


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
