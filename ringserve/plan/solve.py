"""The memory planner (DESIGN §5): the contiguous layer split and the ONE KV
token capacity T that every rank can hold, with T as large as possible.

Rank r holding layers [a, b) fits when, in exact integer bytes,

    weights(a, b) + T * (b - a) * kv_per_token_per_layer + activations_r <= budget_r

where the first rank's weights include the embeddings and the last rank's the
head. Engines that size every rank by the smallest one serve a 32 GB card
beside two 10 GB cards as three 10 GB cards; here the big card takes more
layers, so every rank's pool holds the same T (a slot index names the same
token everywhere, DESIGN §1) and T is what the whole rig can afford.

The solve. Headroom falls as T grows, so feasibility is monotone in T and T is
found by binary search over pages. For one T, `Rig.best_split` computes, by
dynamic programming over (rank, first layer), the largest minimum headroom any
split reaches; T is feasible iff that is >= 0. A greedy "each rank takes as
many layers as fit" is exact only when all layers weigh the same: with layers
of 1, 1, 5, 1 bytes and budgets 2, 1, 100 (KV aside) it gives rank 0 two layers
and leaves rank 1 the 5-byte one, while 1 | 1 | 2 fits. Weights read from a
file need not be uniform, hence the DP, O(ranks * layers^2) per T.

Tie-break, among the splits that reach the maximal T: the largest minimum
headroom (the tightest rank gets the most slack), then the lexicographically
smallest layer_split (earlier ranks take fewer layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog

from ringserve.models.config import ModelConfig
from ringserve.plan.draft import DraftBytes, draft_bytes_from_dir
from ringserve.plan.ledger import (
    Figure,
    Plan,
    PlanError,
    RankLedger,
    budgets_from_mib,
    default_budgets,
    estimate_activations,
    shortfall_message,
)
from ringserve.plan.model_bytes import ModelBytes, model_bytes_from_config, model_bytes_from_dir
from ringserve.plan.objective import Objective, paced
from ringserve.plan.rig import Rig

__all__ = [
    "DraftBytes",
    "Figure",
    "ModelBytes",
    "Objective",
    "Plan",
    "PlanError",
    "RankLedger",
    "budgets_from_mib",
    "default_budgets",
    "estimate_activations",
    "model_bytes_from_config",
    "model_bytes_from_dir",
    "plan",
    "solve",
]

log = structlog.get_logger(__name__)


def solve(
    model: ModelBytes,
    budgets: Sequence[Figure],
    activations: Sequence[Figure],
    *,
    page_size: int = 16,
    min_capacity_tokens: int = 1,
    max_capacity_tokens: int | None = None,
    objective: Objective | None = None,
    draft: DraftBytes | None = None,
) -> Plan:
    """The split and the largest T (a multiple of page_size, at least
    min_capacity_tokens rounded up to a page, at most max_capacity_tokens
    when given) that every rank fits; below the cap no split fits
    T + page_size. Raises PlanError naming the rank that falls short.
    An objective other than capacity (None: capacity) trades some of that T
    for a faster slowest stage (objective.py). `draft`: rank 0 also holds
    a draft model whose pool holds T tokens (plan/draft.py)."""
    objective = objective if objective is not None else Objective()
    if len(budgets) != len(activations) or not budgets:
        raise ValueError(f"{len(budgets)} budgets for {len(activations)} activation figures")
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    rig = Rig.build(model, budgets, activations, objective.speeds, draft)
    check_ranks(rig.ranks, rig.num_layers)
    lo = max(1, -(-min_capacity_tokens // page_size))
    value, split = rig.best_split(lo * page_size)
    if value < 0:
        raise _refusal(rig, rig.least_short(lo * page_size, value), lo * page_size)
    hi = bound = max(lo, _page_bound(rig, page_size))
    if max_capacity_tokens is not None:
        hi = max(lo, min(hi, max_capacity_tokens // page_size))
    top = rig.largest_pages(lo, hi, page_size, None)
    capped = hi < bound and top == hi  # memory would hold more than the cap allows
    if objective.plan_for != "capacity":
        return paced(rig, objective, lo, top, page_size, capped)
    objective.floor_pages(lo, top, page_size, capped)  # refuses a --min-kv-tokens above the top
    capacity = top * page_size
    split = rig.best_split(capacity)[1]
    return Plan(split, capacity, page_size, rig.ledger(split, capacity))


def _page_bound(rig: Rig, page_size: int) -> int:
    """Pages no split can exceed: summed over ranks, headroom is every budget
    less every fixed cost, all weights and T * L * kv, whatever the split."""
    spare = sum(rig.room(r, 0, 0, 0) for r in range(rig.ranks)) - rig.prefix[-1]
    per_token = rig.num_layers * rig.model.kv_per_token_per_layer.bytes
    if rig.draft is not None:
        per_token += rig.draft.kv_per_token.bytes
    per_page = page_size * per_token
    return spare // per_page


def _refusal(rig: Rig, split: tuple[int, ...], capacity: int) -> PlanError:
    """`split` is a split whose worst deficit is smallest (and, of those,
    whose summed deficit is least); name its worst rank: every other split
    leaves some rank at least that far short, so this shortfall is the least
    the operator must find."""
    ledger = rig.ledger(split, capacity)
    worst = min(ledger, key=lambda e: e.headroom)
    log.warning("plan.refused", rank=worst.rank, shortfall=-worst.headroom, split=list(split))
    return PlanError(shortfall_message(worst, capacity, split), shortfall=worst)


def check_ranks(ranks: int, num_layers: int) -> None:
    """PlanError unless every rank can hold a layer."""
    if ranks > num_layers:
        raise PlanError(
            f"{ranks} ranks for a model of {num_layers} layers: every rank needs a layer"
        )


def plan(
    model: ModelConfig | str | Path,
    *,
    pp_size: int,
    rank_memory_mib: Sequence[int] | str | None = None,
    max_num_tokens_per_pass: int = 2048,
    max_num_seqs: int = 256,
    dtype: str = "float32",
    page_size: int = 16,
    activations: Sequence[Figure] | None = None,
    max_capacity_tokens: int | None = None,
    objective: Objective | None = None,
    draft_model: str | Path | None = None,
    device: str = "auto",
    measured: Sequence[int] | None = None,
) -> Plan:
    """Plan a model (a ModelConfig, or a model directory whose safetensors
    headers give the weight bytes) over pp_size ranks. The pool must hold at
    least one largest pass plus the padding slot 0. `draft_model`: the
    directory of the draft model rank 0 runs (`--speculative draft`),
    charged to rank 0 (plan/draft.py). `device`: where the ranks run
    (`EngineConfig.device`), which measures their budgets when none are
    given; `measured`: each rank's budget as measured where it runs (a
    ring of several nodes gathers them), instead of measuring here."""
    if isinstance(model, ModelConfig):
        cfg, weights = model, model_bytes_from_config(model, dtype)
    else:
        cfg = ModelConfig.from_dir(model)
        weights = model_bytes_from_dir(model, cfg, dtype)
    check_ranks(pp_size, cfg.num_layers)  # before a budget or an estimate is made per rank
    if measured is not None:
        budgets = [Figure(int(b), "measured") for b in measured]
    elif rank_memory_mib is None:
        budgets = default_budgets(pp_size, device)
    else:
        budgets = budgets_from_mib(rank_memory_mib)
    if len(budgets) != pp_size:
        raise ValueError(f"{len(budgets)} rank memory budgets for pp_size {pp_size}")
    if activations is None:
        activations = [
            estimate_activations(
                cfg,
                dtype,
                rank=r,
                pp_size=pp_size,
                max_num_tokens_per_pass=max_num_tokens_per_pass,
                max_num_seqs=max_num_seqs,
            )
            for r in range(pp_size)
        ]
    draft = None
    if draft_model is not None:
        draft = draft_bytes_from_dir(
            draft_model,
            dtype,
            max_num_tokens_per_pass=max_num_tokens_per_pass,
            max_num_seqs=max_num_seqs,
        )
    result = solve(
        weights,
        budgets,
        activations,
        page_size=page_size,
        min_capacity_tokens=max_num_tokens_per_pass + 1,
        max_capacity_tokens=max_capacity_tokens,
        objective=objective,
        draft=draft,
    )
    log.debug("plan.solved", **result.to_dict())  # the CLI prints the table itself
    return result
