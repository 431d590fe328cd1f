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
found by binary search over pages. For one T, `_Rig.best_split` computes, by
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
from dataclasses import dataclass
from pathlib import Path

import structlog

from ringserve.models.config import _DTYPE_BYTES, ModelConfig
from ringserve.plan.ledger import (
    Figure,
    Plan,
    PlanError,
    RankLedger,
    budgets_from_mib,
    default_budgets,
    estimate_activations,
    shortfall_message,
    total,
)

__all__ = [
    "Figure",
    "ModelBytes",
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


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What the solve needs to know about a model. `tied` is the part of
    `head` that is the embedding matrix itself (tied embeddings): the last
    rank holds its own copy, but one rank holding both stores it once."""

    embed: Figure
    layers: tuple[Figure, ...]
    head: Figure
    kv_per_token_per_layer: Figure
    tied: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one decoder layer")
        if self.kv_per_token_per_layer.bytes <= 0:
            raise ValueError("KV bytes per token per layer must be positive")
        if not 0 <= self.tied <= min(self.embed.bytes, self.head.bytes):
            raise ValueError(f"tied bytes {self.tied} exceed the embedding or the head")


def model_bytes_from_config(cfg: ModelConfig, dtype: str) -> ModelBytes:
    """Weight bytes from the config's parameter counts, all source "config"."""
    elem = _DTYPE_BYTES[dtype]
    embed, layer, head, tied = _param_counts(cfg)
    return ModelBytes(
        embed=Figure(embed * elem, "config"),
        layers=(Figure(layer * elem, "config"),) * cfg.num_layers,
        head=Figure(head * elem, "config"),
        kv_per_token_per_layer=Figure(cfg.kv_bytes_per_token_per_layer(dtype), "config"),
        tied=tied * elem,
    )


_O_PROJ_BIAS = {"llama", "qwen3"}  # Qwen2 biases q, k, v but not o


def _param_counts(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(embed, one decoder layer, head, tied) parameter counts, as the
    Hugging Face modules of each family lay them out."""
    if cfg.family == "gpt_bigcode":
        return _bigcode_counts(cfg)
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    attn = 2 * h * q + 2 * h * kv
    if cfg.attention_bias:
        attn += q + 2 * kv + (h if cfg.model_type in _O_PROJ_BIAS else 0)
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    layer = attn + 3 * h * cfg.intermediate_size + 2 * h  # gate, up, down; two RMSNorms
    vocab = cfg.vocab_size * h
    return vocab, layer, h + vocab, vocab if cfg.tie_word_embeddings else 0


def _bigcode_counts(cfg: ModelConfig) -> tuple[int, int, int, int]:
    h, inner = cfg.hidden_size, cfg.intermediate_size
    qkv = h + 2 * cfg.head_dim  # multi-query: one K and one V head
    layer = (h + 1) * qkv + (h + 1) * h + (h + 1) * inner + (inner + 1) * h + 4 * h
    vocab = cfg.vocab_size * h
    embed = vocab + cfg.max_position_embeddings * h  # token and learned position tables
    return embed, layer, 2 * h + vocab, vocab


def model_bytes_from_dir(model_dir: str | Path, cfg: ModelConfig, dtype: str) -> ModelBytes:
    """Weight bytes from the safetensors headers (source "file"), nothing
    loaded. Weights are served in `dtype`, so each tensor counts its element
    count times the bytes of `dtype`, whatever dtype the file stores it in.
    With tied embeddings `head` holds the embedding matrix's copy and `tied`
    its size, as `WeightIndex.stage_bytes` counts a stage's tensors."""
    import torch

    from ringserve.models.weights import WeightIndex, embedding_matrix_name

    index, serving = WeightIndex.from_dir(model_dir), getattr(torch, dtype)
    parts = index.bytes_by_part(cfg, serving)
    matrix = embedding_matrix_name(cfg)
    tied = index.nbytes(matrix, serving) if cfg.tie_word_embeddings and matrix in index else 0
    return ModelBytes(
        embed=Figure(parts.embed, "file"),
        layers=tuple(Figure(n, "file") for n in parts.layers),
        head=Figure(parts.head, "file"),
        kv_per_token_per_layer=Figure(cfg.kv_bytes_per_token_per_layer(dtype), "config"),
        tied=tied,
    )


@dataclass(frozen=True, slots=True)
class _Rig:
    """One solve's inputs as integers. Invariant: the headroom of rank r
    holding layers [a, b) at capacity t is exactly
    spare[r] - (prefix[b] - prefix[a]) - t * (b - a) * kv, where spare[r] is
    the budget less the activations and less `fixed[r]`, the rank's share of
    embeddings and head: the one definition both the DP and the ledger use."""

    model: ModelBytes
    budgets: tuple[Figure, ...]
    activations: tuple[Figure, ...]
    prefix: tuple[int, ...]
    fixed: tuple[int, ...]

    @classmethod
    def build(cls, model: ModelBytes, budgets: Sequence[Figure], acts: Sequence[Figure]) -> _Rig:
        ranks = len(budgets)
        prefix = [0]
        for layer in model.layers:
            prefix.append(prefix[-1] + layer.bytes)
        fixed = [0] * ranks
        fixed[0] += model.embed.bytes
        fixed[-1] += model.head.bytes - (model.tied if ranks == 1 else 0)
        return cls(model, tuple(budgets), tuple(acts), tuple(prefix), tuple(fixed))

    @property
    def ranks(self) -> int:
        return len(self.budgets)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def room(self, r: int, a: int, b: int, t: int) -> int:
        spare = self.budgets[r].bytes - self.activations[r].bytes - self.fixed[r]
        kv = t * (b - a) * self.model.kv_per_token_per_layer.bytes
        return spare - (self.prefix[b] - self.prefix[a]) - kv

    def best_split(self, t: int) -> tuple[int, tuple[int, ...]]:
        """The largest minimum headroom over all splits at capacity t, and the
        lexicographically smallest split that reaches it."""
        ranks, layers = self.ranks, self.num_layers
        best = self._suffix_best(t)
        value, split, a = best[0][0], [], 0
        for r in range(ranks - 1):
            last = layers - (ranks - 1 - r)
            b = next(
                b
                for b in range(a + 1, last + 1)
                if min(self.room(r, a, b, t), best[r + 1][b]) >= value
            )
            split.append(b - a)
            a = b
        split.append(layers - a)
        return value, tuple(split)

    def _suffix_best(self, t: int) -> list[list[int]]:
        """best[r][a]: the largest minimum headroom of ranks r.. holding
        layers [a, L), each rank at least one layer. Only starts a that leave
        a layer for every rank before and after are filled in."""
        ranks, layers = self.ranks, self.num_layers
        best = [[0] * (layers + 1) for _ in range(ranks)]
        for a in range(ranks - 1, layers):
            best[-1][a] = self.room(ranks - 1, a, layers, t)
        for r in range(ranks - 2, -1, -1):
            last = layers - (ranks - 1 - r)
            for a in range(r, last):
                best[r][a] = max(
                    min(self.room(r, a, b, t), best[r + 1][b]) for b in range(a + 1, last + 1)
                )
        return best

    def ledger(self, split: tuple[int, ...], t: int) -> tuple[RankLedger, ...]:
        entries, a = [], 0
        kv = self.model.kv_per_token_per_layer
        for r, n in enumerate(split):
            parts = list(self.model.layers[a : a + n])
            parts += [self.model.embed] if r == 0 else []
            parts += [self.model.head] if r == self.ranks - 1 else []
            weights = Figure(
                self.fixed[r] + self.prefix[a + n] - self.prefix[a], total(parts).source
            )
            entries.append(
                RankLedger(
                    rank=r,
                    layers=range(a, a + n),
                    budget=self.budgets[r],
                    weights=weights,
                    kv=Figure(t * n * kv.bytes, kv.source),
                    activations=self.activations[r],
                )
            )
            a += n
        return tuple(entries)


def solve(
    model: ModelBytes,
    budgets: Sequence[Figure],
    activations: Sequence[Figure],
    *,
    page_size: int = 16,
    min_capacity_tokens: int = 1,
    max_capacity_tokens: int | None = None,
) -> Plan:
    """The split and the largest T (a multiple of page_size, at least
    min_capacity_tokens rounded up to a page, at most max_capacity_tokens
    when given) that every rank fits; below the cap no split fits
    T + page_size. Raises PlanError naming the rank that falls short."""
    if len(budgets) != len(activations) or not budgets:
        raise ValueError(f"{len(budgets)} budgets for {len(activations)} activation figures")
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    rig = _Rig.build(model, budgets, activations)
    if rig.ranks > rig.num_layers:
        raise PlanError(
            f"{rig.ranks} ranks for a model of {rig.num_layers} layers: every rank needs a layer"
        )
    lo = max(1, -(-min_capacity_tokens // page_size))
    value, split = rig.best_split(lo * page_size)
    if value < 0:
        raise _refusal(rig, split, lo * page_size)
    hi = max(lo, _page_bound(rig, page_size))
    if max_capacity_tokens is not None:
        hi = max(lo, min(hi, max_capacity_tokens // page_size))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if rig.best_split(mid * page_size)[0] >= 0:
            lo = mid
        else:
            hi = mid - 1
    capacity = lo * page_size
    split = rig.best_split(capacity)[1]
    return Plan(split, capacity, page_size, rig.ledger(split, capacity))


def _page_bound(rig: _Rig, page_size: int) -> int:
    """Pages no split can exceed: summed over ranks, headroom is every budget
    less every fixed cost, all weights and T * L * kv, whatever the split."""
    spare = sum(rig.room(r, 0, 0, 0) for r in range(rig.ranks)) - rig.prefix[-1]
    per_page = page_size * rig.num_layers * rig.model.kv_per_token_per_layer.bytes
    return spare // per_page


def _refusal(rig: _Rig, split: tuple[int, ...], capacity: int) -> PlanError:
    """`split` is the split whose worst deficit is smallest; name its worst
    rank: every other split leaves some rank at least that far short, so this
    shortfall is the least the operator must find."""
    ledger = rig.ledger(split, capacity)
    worst = min(ledger, key=lambda e: e.headroom)
    log.warning("plan.refused", rank=worst.rank, shortfall=-worst.headroom, split=list(split))
    return PlanError(shortfall_message(worst, capacity, split), shortfall=worst)


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
) -> Plan:
    """Plan a model (a ModelConfig, or a model directory whose safetensors
    headers give the weight bytes) over pp_size ranks. The pool must hold at
    least one largest pass plus the padding slot 0."""
    if isinstance(model, ModelConfig):
        cfg, weights = model, model_bytes_from_config(model, dtype)
    else:
        cfg = ModelConfig.from_dir(model)
        weights = model_bytes_from_dir(model, cfg, dtype)
    if rank_memory_mib is None:
        budgets = default_budgets(pp_size)
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
    result = solve(
        weights,
        budgets,
        activations,
        page_size=page_size,
        min_capacity_tokens=max_num_tokens_per_pass + 1,
        max_capacity_tokens=max_capacity_tokens,
    )
    log.info("plan.solved", **result.to_dict())
    return result
