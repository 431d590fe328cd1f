"""What a plan is for (DESIGN §5): the largest KV capacity, the fastest
ring, or the fastest ring that gives up little capacity.

A pipeline runs one pass per slowest stage, so the ring's pace is the
largest stage time, layers / speed (reference-layer times; `RankLedger`).
Only integers and exact fractions are compared, and the searches are exact:

  throughput  the smallest bottleneck B over the splits that fit the floor
              capacity (at least --min-kv-tokens and one largest pass), then
              the largest T among splits no slower than B.
  balanced    the same with the floor at BALANCED_PERCENT below the largest T
              any split holds (and at least --min-kv-tokens).
  capacity    the largest T (solve.py), the bottleneck only reported.

B is one of the R * L values n / speed[r]; feasibility is monotone in B (a
larger B only loosens each rank's cap of floor(B * speed[r]) layers), so B
is found by binary search over them, each step one capped DP at the floor.
Among the splits within B's caps at the chosen T, the tie-break is solve's:
the largest minimum headroom, then the lexicographically smallest split.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import structlog

from ringserve.config import PLAN_FOR
from ringserve.plan.ledger import BALANCED_PERCENT, Plan, PlanError
from ringserve.plan.rig import Rig

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Objective:
    """`plan_for` one of PLAN_FOR; `speeds` one positive factor per rank
    (None: all equal); `min_kv_tokens` a floor on T in every mode (None:
    one largest pass)."""

    plan_for: str = "capacity"
    speeds: tuple[float, ...] | None = None
    min_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.plan_for not in PLAN_FOR:
            raise ValueError(f"plan_for must be one of {list(PLAN_FOR)}, not {self.plan_for!r}")
        if self.speeds is not None and not all(s > 0 for s in self.speeds):
            raise ValueError(f"rank speeds must be positive, got {list(self.speeds)}")
        if self.min_kv_tokens is not None and self.min_kv_tokens < 1:
            raise ValueError(f"min_kv_tokens must be positive, got {self.min_kv_tokens}")

    def floor_pages(self, least: int, top: int, page_size: int, capped: bool = False) -> int:
        """The fewest pages a plan may hold: `least` (one largest pass),
        --min-kv-tokens, and in balanced mode BALANCED_PERCENT below `top`,
        the most pages any split holds (`capped`: the configured cap, not
        memory, set it). Refuses when above `top`."""
        floor = max(least, -(-(self.min_kv_tokens or 0) // page_size))
        if self.plan_for == "balanced":
            floor = max(floor, -(-top * (100 - BALANCED_PERCENT) // 100))
        if floor > top:
            fix = (
                "raise --kv-capacity-tokens, which caps the pool when no budgets are given"
                if capped
                else "give the ranks more memory, or add a rank"
            )
            raise PlanError(
                f"no layer split holds --min-kv-tokens {self.min_kv_tokens}: the most any "
                f"split holds is {top * page_size} tokens, {floor * page_size - top * page_size} "
                f"short; lower --min-kv-tokens, or {fix}"
            )
        return floor


def paced(
    rig: Rig, objective: Objective, least: int, top: int, page_size: int, capped: bool = False
) -> Plan:
    """The plan for throughput or balanced, given that `least` pages fit
    and `top` is the most pages any split holds (both within any cap;
    `capped`: the cap set `top`)."""
    floor = objective.floor_pages(least, top, page_size, capped)
    caps = rig.caps_for(_fastest_bottleneck(rig, floor * page_size))
    pages = rig.largest_pages(floor, top, page_size, caps)
    split = rig.best_split(pages * page_size, caps)[1]
    capacity = pages * page_size
    return Plan(split, capacity, page_size, rig.ledger(split, capacity), objective.plan_for)


def _fastest_bottleneck(rig: Rig, t: int) -> Fraction:
    """The smallest stage time B such that a split with no stage slower
    than B fits capacity t. The largest candidate, L / slowest speed,
    caps no rank, and some split fits t, so the search always ends."""
    candidates = sorted(
        {rig.stage_time(r, n) for r in range(rig.ranks) for n in range(1, rig.num_layers + 1)}
    )
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if rig.best_split(t, rig.caps_for(candidates[mid]))[0] >= 0:
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]
