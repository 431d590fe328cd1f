"""The memory ledger of a plan: every figure the planner added up, per rank,
where each figure came from, and how a plan renders them (DESIGN §5).

A figure's provenance is one of:
  "file"     read from safetensors headers, nothing loaded
  "config"   derived from config.json
  "measured" measured on the rank (free device memory, a dry forward)
  "given"    passed on the command line or as an argument
Figures summed from several sources carry them joined with "+".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from ringserve.config import MAX_MIB, PLAN_FOR, rank_device
from ringserve.models.config import _DTYPE_BYTES, ModelConfig

if TYPE_CHECKING:
    from ringserve.plan.draft import DraftLedger

log = structlog.get_logger(__name__)

SOURCES = ("file", "config", "measured", "given")

MIB = 1 << 20
GIB = 1 << 30

CUDA_RESERVE_FRACTION = 20  # keep 1/20 of the card (at least CUDA_RESERVE_MIN) for the
CUDA_RESERVE_MIN = GIB  # allocator's fragmentation and the kernels' own workspaces
CPU_SHARE = 2  # on CPU, ranks share 1/CPU_SHARE of MemAvailable: the OS and others keep the rest


@dataclass(frozen=True, slots=True)
class Figure:
    """A non-negative byte count and its provenance."""

    bytes: int
    source: str

    def __post_init__(self) -> None:
        if self.bytes < 0:
            raise ValueError(f"a memory figure cannot be negative: {self.bytes} bytes")
        if any(part not in SOURCES for part in self.source.split("+")):
            raise ValueError(f"unknown figure source {self.source!r}: one of {SOURCES}")

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "source": self.source}


def total(figures: Iterable[Figure]) -> Figure:
    """Sum of figures; the source lists each contributing provenance once."""
    figures = list(figures)
    if not figures:
        raise ValueError("a total needs at least one figure")
    sources = sorted({part for f in figures for part in f.source.split("+")}, key=SOURCES.index)
    return Figure(sum(f.bytes for f in figures), "+".join(sources))


def estimate_activations(
    cfg: ModelConfig,
    dtype: str,
    *,
    rank: int,
    pp_size: int,
    max_num_tokens_per_pass: int,
    max_num_seqs: int = 256,
) -> Figure:
    """Peak transient bytes of one pass on `rank`, from the config. With
    N = max_num_tokens_per_pass, S = min(N, max_num_seqs) sampled rows and
    e = bytes of `dtype`:

        every rank   N * e * (6h + 2q + 2kv + 3i + 2d [+ q + kv]) + N * 4 * (2h + 2q)
            6h: hidden and residual received, the normed input, the layer
                output, hidden and residual to send (retained until delivered);
            2q: queries and attention output; 2kv: new K and V rows;
            3i: gate, up and their product. Layers run one after another, so
                one layer's working set is live at a time.
            2d: the pass's rope tables (cos and sin of head_dim d);
            q + kv: with a q/k norm, the normed queries and keys before they
                are joined;
            2h in float32: an RMSNorm's temporaries; 2q in float32: on the
                CPU, the running merge of a long context's attention, which
                copies at most N context tokens' K and V at once
                (`kernels/attention_bounded.py`).
        last rank    + S * vocab * 8: float32 logits and probabilities.

    Attention score matrices are not counted (the paged kernels stream over
    the context). The boot audit measures the exact peak of a dry forward
    at this pass (`plan/audit.py`) and reports any excess as unforeseen."""
    n, e = max_num_tokens_per_pass, _DTYPE_BYTES[dtype]
    width = 6 * cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    width += 2 * cfg.head_dim  # the pass's rope tables, cos and sin
    if cfg.qk_norm:
        width += cfg.q_size + cfg.kv_size  # the normed queries and keys before their cat
    # + a norm's float32 temporaries, and the float32 merge of a long
    # context's attention tiles (kernels/attention_bounded.py)
    peak = n * (e * width + 4 * (2 * cfg.hidden_size + 2 * cfg.q_size))
    if rank == pp_size - 1:
        peak += min(n, max_num_seqs) * cfg.vocab_size * 8
    return Figure(peak, "config")


def budgets_from_mib(rank_memory_mib: Sequence[int] | str) -> list[Figure]:
    """`28000,9000,9000` or [28000, 9000, 9000] -> budgets of source "given"."""
    if isinstance(rank_memory_mib, str):
        rank_memory_mib = [int(part) for part in rank_memory_mib.split(",")]
    for mib in rank_memory_mib:
        if not 0 <= int(mib) <= MAX_MIB:
            raise ValueError(
                f"rank memory budgets are in MiB, 0 to {MAX_MIB} (16 TiB), got {mib}: "
                "28000 for a 28 GB card"
            )
    return [Figure(int(mib) * MIB, "given") for mib in rank_memory_mib]


def visible_gpus() -> int:
    """How many CUDA devices torch sees here (0 without CUDA): what
    `config.rank_device` places ranks on."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_budgets(pp_size: int, device: str = "auto", ranks: range | None = None) -> list[Figure]:
    """Measured budgets of `ranks` (default: all of the ring's) on this
    machine, each rank's where it runs (`config.rank_device`): a GPU's free
    memory less a reserve (logged), shared equally by those ranks placed on
    that GPU; the CPU's 1/CPU_SHARE of MemAvailable, shared equally by those
    ranks on the CPU. `auto`: every rank on the GPUs when torch sees one,
    else on the CPU."""
    import torch

    count = visible_gpus()
    ranks = range(pp_size) if ranks is None else ranks
    places = [rank_device(device, r, count) for r in ranks]
    per_place = {}
    for place, ranks in sorted(Counter(places).items()):
        if place == "cpu":
            available = mem_available()
            per_place[place] = available // CPU_SHARE // ranks
            log.debug("plan.budget", device=place, available=available, ranks=ranks)
            continue
        free, whole = torch.cuda.mem_get_info(torch.device(place))
        reserve = max(CUDA_RESERVE_MIN, whole // CUDA_RESERVE_FRACTION)
        per_place[place] = max(0, free - reserve) // ranks
        log.debug("plan.budget", device=place, free=free, reserve=reserve, ranks=ranks)
    return [Figure(per_place[place], "measured") for place in places]


def mem_available() -> int:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError as exc:
        raise PlanError(f"cannot read /proc/meminfo ({exc}): pass --rank-memory-mib") from exc
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise PlanError("/proc/meminfo has no MemAvailable: pass --rank-memory-mib")


@dataclass(frozen=True, slots=True)
class RankLedger:
    """What one rank must hold, and how long its stage takes. Invariant of a
    valid plan: headroom >= 0, where headroom = budget - weights - kv -
    activations - draft exactly (`draft`: the draft model rank 0 runs for
    `--speculative draft`, plan/draft.py; None on every other rank). `speed` is the rank's planned speed per layer
    relative to the reference (2.0: twice as fast); its predicted stage time
    per pass is (layers + head_time) / speed, in reference-layer times, where
    `head_time` is the head's weight bytes in mean layers on the last rank
    (0 elsewhere; the embedding lookup and sampling are not timed)."""

    rank: int
    layers: range
    budget: Figure
    weights: Figure
    kv: Figure
    activations: Figure
    speed: float = 1.0
    head_time: float = 0.0
    host: Figure | None = None  # the host KV tier, in host memory: not in the budget
    draft: DraftLedger | None = None

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"rank {self.rank}: speed must be positive, got {self.speed}")

    @property
    def stage_time(self) -> float:
        return (len(self.layers) + self.head_time) / self.speed

    @property
    def needs(self) -> int:
        extra = self.draft.total if self.draft is not None else 0
        return self.weights.bytes + self.kv.bytes + self.activations.bytes + extra

    @property
    def headroom(self) -> int:
        return self.budget.bytes - self.needs

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "layers": [self.layers.start, self.layers.stop],
            "budget": self.budget.to_dict(),
            "weights": self.weights.to_dict(),
            "kv": self.kv.to_dict(),
            "activations": self.activations.to_dict(),
            "headroom": self.headroom,
            "speed": self.speed,
            "stage_time": self.stage_time,
            **({"host_kv": self.host.to_dict()} if self.host is not None else {}),
            **({"draft": self.draft.to_dict()} if self.draft is not None else {}),
        }


class PlanError(ValueError):
    """No layer split fits. Carries the ledger of the rank that falls short
    (in the best split there is) so callers can report it structurally."""

    def __init__(self, message: str, shortfall: RankLedger | None = None) -> None:
        super().__init__(message)
        self.shortfall = shortfall


def shortfall_message(entry: RankLedger, capacity_tokens: int, split: tuple[int, ...]) -> str:
    """`rank 2 cannot hold its slice: needs 9.4 GiB, budget 9.0 GiB (...)`
    (MiB below a GiB, where a tenth of a GiB would read as nothing)."""
    layers = entry.layers
    return (
        f"rank {entry.rank} cannot hold its slice of {len(layers)} layers "
        f"({layers.start}-{layers.stop - 1}) with a KV pool of {capacity_tokens} tokens: "
        f"needs {_size(entry.needs)}, budget {_size(entry.budget.bytes)}, "
        f"short by {_size(-entry.headroom)} (weights {_size(entry.weights.bytes)}, "
        f"KV {_size(entry.kv.bytes)}, {_draft_part(entry)}"
        f"activations {_size(entry.activations.bytes)}); "
        f"that is the best layer split there is, {list(split)}: give rank {entry.rank} "
        f"more memory, add a rank, or serve a smaller dtype"
        + (" or a smaller draft model" if entry.draft is not None else "")
    )


def _draft_part(entry: RankLedger) -> str:
    """`draft 1.2 (weights 0.9, KV 0.2, activations 0.1), ` or nothing."""
    d = entry.draft
    if d is None:
        return ""
    return (
        f"draft {_size(d.total)} (weights {_size(d.weights.bytes)}, KV {_size(d.kv.bytes)}, "
        f"activations {_size(d.activations.bytes)}), "
    )


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True, slots=True)
class Plan:
    """A solved plan. Invariants: layer_split has one entry >= 1 per rank and
    the ledger's layer ranges tile the model in order; every rank's KV pool
    holds capacity_tokens (a multiple of page_size; like KVPool.capacity it
    counts the padding slot 0); every headroom >= 0. `plan_for` is the
    objective it was solved for (PLAN_FOR)."""

    layer_split: tuple[int, ...]
    capacity_tokens: int
    page_size: int
    ledger: tuple[RankLedger, ...]
    plan_for: str = "capacity"
    host_tokens: int = 0  # H, the host KV tier of every rank (plan/host.py); 0: none

    def __post_init__(self) -> None:
        if self.plan_for not in PLAN_FOR:
            raise ValueError(f"plan_for must be one of {list(PLAN_FOR)}, not {self.plan_for!r}")

    @property
    def num_layers(self) -> int:
        return sum(self.layer_split)

    @property
    def bottleneck(self) -> RankLedger:
        """The rank whose stage is slowest (the first of equals): it sets
        the ring's pace, one pass per its stage time."""
        return max(self.ledger, key=lambda e: e.stage_time)

    def table(self) -> str:
        """One row per rank, figures in MiB with their provenance, then totals."""
        head = (
            "rank",
            "layers",
            "budget",
            "weights",
            "KV",
            "activations",
            "headroom",
            "speed",
            "stage",
        )
        rows = [head] + [self._row(e) for e in self.ledger] + [self._totals()]
        if self.host_tokens:
            rows = [(*row, cell) for row, cell in zip(rows, self._host_cells(), strict=True)]
        if self.has_draft:
            rows = [(*row, cell) for row, cell in zip(rows, self._draft_cells(), strict=True)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.insert(len(lines) - 1, lines[1])
        lines.append(
            f"T = {self.capacity_tokens} tokens on every rank "
            f"(page {self.page_size}, {self.capacity_tokens // self.page_size} pages); "
            f"figures in MiB"
        )
        if self.host_tokens:
            lines.append(f"H = {self.host_tokens} tokens in host memory on every rank")
        if self.has_draft:
            d = self.ledger[0].draft
            lines.append(
                f"draft on rank 0: weights {_mib(d.weights.bytes)} {d.weights.source}, "
                f"KV {_mib(d.kv.bytes)} {d.kv.source} ({self.capacity_tokens} tokens), "
                f"activations {_mib(d.activations.bytes)} {d.activations.source}"
            )
        slow = self.bottleneck
        lines.append(
            f"bottleneck: rank {slow.rank}, {slow.stage_time:.2f} layer-times per pass "
            f"({len(slow.layers)} layers at speed {slow.speed:g}); planned for {self.plan_for}"
        )
        return "\n".join(lines)

    @staticmethod
    def _row(e: RankLedger) -> tuple[str, ...]:
        cells = [e.budget, e.weights, e.kv, e.activations]
        span = f"{e.layers.start}-{e.layers.stop - 1} ({len(e.layers)})"
        return (
            str(e.rank),
            span,
            *(f"{_mib(f.bytes)} {f.source}" for f in cells),
            _mib(e.headroom),
            f"{e.speed:g}",
            f"{e.stage_time:.2f}",
        )

    @property
    def has_draft(self) -> bool:
        return any(e.draft is not None for e in self.ledger)

    def _draft_cells(self) -> list[str]:
        figures = [e.draft for e in self.ledger]
        cells = [f"{_mib(d.total)} {d.source}" if d is not None else "-" for d in figures]
        return ["draft", *cells, _mib(sum(d.total for d in figures if d is not None))]

    def _host_cells(self) -> list[str]:
        figures = [e.host for e in self.ledger if e.host is not None]
        cells = [f"{_mib(f.bytes)} {f.source}" for f in figures]
        return ["host KV", *cells, _mib(sum(f.bytes for f in figures))]

    def _totals(self) -> tuple[str, ...]:
        sums = [sum(getattr(e, k).bytes for e in self.ledger) for k in _COMPONENTS]
        room = sum(e.headroom for e in self.ledger)
        pace = f"{self.bottleneck.stage_time:.2f}"
        return ("all", f"{self.num_layers}", *(_mib(s) for s in sums), _mib(room), "", pace)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, for the `plan.solved` log event and GET /v1/plan."""
        return {
            "layer_split": list(self.layer_split),
            "capacity_tokens": self.capacity_tokens,
            "page_size": self.page_size,
            "plan_for": self.plan_for,
            **({"host_tokens": self.host_tokens} if self.host_tokens else {}),
            "bottleneck": self.bottleneck.rank,
            "ranks": [e.to_dict() for e in self.ledger],
            "totals": {
                **{k: sum(getattr(e, k).bytes for e in self.ledger) for k in _COMPONENTS},
                **({"draft": self.ledger[0].draft.total} if self.has_draft else {}),
            },
        }


_COMPONENTS = ("budget", "weights", "kv", "activations")

BALANCED_PERCENT = 5  # balanced plans give up at most this share of the largest T
