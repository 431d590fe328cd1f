"""Each rank's boot-time audit: what it allocated, and the activation peak it
measured with a dry forward, against its ledger row (DESIGN §5: no
allocation made after the plan may be missing from it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
import torch

from ringserve.engine.runner import Runner

log = structlog.get_logger(__name__)


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
