"""The draft column of the memory ledger (`--speculative draft`): rank 0 runs
the draft model, all of its layers, beside its own slice of the target, so
rank 0's ledger row charges its weights, its KV pool and its activations
(DESIGN §5: no allocation made after the plan may be missing from it).

The rule for the draft's KV pool: it holds the same token capacity T as
every rank's target pool. The drafter keeps one row of its own slots per
request it proposes for, holding that request's history, and a request's
history is held in T slots of the target pool too, so a draft pool of T
tokens holds whatever the target's pool holds for the requests it drafts
for. Its bytes grow with T, so the solve charges rank 0
T * draft_kv_per_token on top of its target layers' KV: the draft takes
room from rank 0's target layers and from the one capacity alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.models.config import ModelConfig
from ringserve.plan.ledger import Figure, estimate_activations, total
from ringserve.plan.model_bytes import model_bytes_from_dir


@dataclass(frozen=True, slots=True)
class DraftBytes:
    """What the solve needs to know about a draft model: its weights (one
    rank holds all of it, tied embeddings stored once), its KV bytes per
    token over all of its layers, and the activation peak of one of its
    forwards."""

    weights: Figure
    kv_per_token: Figure
    activations: Figure

    def __post_init__(self) -> None:
        if self.kv_per_token.bytes <= 0:
            raise ValueError("a draft model's KV bytes per token must be positive")

    def at(self, capacity_tokens: int) -> DraftLedger:
        """The draft's ledger entry with a pool of `capacity_tokens` (slot 0
        counted, as KVPool counts it)."""
        kv = Figure(capacity_tokens * self.kv_per_token.bytes, self.kv_per_token.source)
        return DraftLedger(self.weights, kv, self.activations)


@dataclass(frozen=True, slots=True)
class DraftLedger:
    """Rank 0's draft entry: weights, KV pool and activations, each with its
    provenance; `total` is what it adds to rank 0's needs."""

    weights: Figure
    kv: Figure
    activations: Figure

    @property
    def total(self) -> int:
        return self.weights.bytes + self.kv.bytes + self.activations.bytes

    @property
    def source(self) -> str:
        return total((self.weights, self.kv, self.activations)).source

    def to_dict(self) -> dict[str, Any]:
        parts = {k: getattr(self, k).to_dict() for k in ("weights", "kv", "activations")}
        return {"bytes": self.total, "source": self.source, **parts}


def draft_config(draft_dir: str | Path, served: ModelConfig) -> ModelConfig:
    """The draft model's config; ValueError when its vocabulary is not the
    served model's (the two read and write one stream of token ids)."""
    cfg = ModelConfig.from_dir(draft_dir)
    if cfg.vocab_size != served.vocab_size:
        raise ValueError(
            f"draft model {draft_dir} has a vocabulary of {cfg.vocab_size} tokens, the served "
            f"model {served.vocab_size}: they must share one tokenizer"
        )
    return cfg


def draft_bytes_from_dir(
    draft_dir: str | Path, dtype: str, *, max_num_tokens_per_pass: int, max_num_seqs: int
) -> DraftBytes:
    """The draft's figures: weights from its safetensors headers served in
    `dtype` (source "file"), KV per token from its config, and its
    activations estimated as one rank holding the whole draft (its logits
    included) at the largest pass the server runs."""
    cfg = ModelConfig.from_dir(draft_dir)
    parts = model_bytes_from_dir(draft_dir, cfg, dtype)
    weights = parts.embed.bytes + sum(f.bytes for f in parts.layers) + parts.head.bytes
    activations = estimate_activations(
        cfg,
        dtype,
        rank=0,
        pp_size=1,
        max_num_tokens_per_pass=max_num_tokens_per_pass,
        max_num_seqs=max_num_seqs,
    )
    return DraftBytes(
        weights=Figure(weights - parts.tied, "file"),
        kv_per_token=Figure(cfg.num_layers * cfg.kv_bytes_per_token_per_layer(dtype), "config"),
        activations=activations,
    )
