"""The host column of the memory ledger: the host KV tier of every rank
holds the same number of tokens H (a host slot names the same token on
every rank, as a device slot does), so a rank with more layers needs more
host bytes. Given `host_kv_tokens`, each rank's bytes follow; given
`host_kv_mib` per rank, H is the most that every rank's budget holds."""

from __future__ import annotations

from dataclasses import replace

from ringserve.config import EngineConfig
from ringserve.models.config import ModelConfig
from ringserve.plan.ledger import MIB, Figure, Plan


def solve_host(config: EngineConfig, cfg: ModelConfig, dtype: str) -> tuple[int, list[Figure]]:
    """H and each rank's host KV bytes under the config's layer split (the
    padding slot 0 included, as the host pool allocates it)."""
    split = config.layer_split or (cfg.num_layers,)
    per_layer = cfg.kv_bytes_per_token_per_layer(dtype)
    if config.host_kv_mib is None:
        tokens, source = config.host_kv_tokens, "given+config"  # tokens given, bytes per token
    elif config.host_kv_tokens:
        raise ValueError(
            "give host_kv_tokens or host_kv_mib, not both: the planner solves the tokens"
        )
    else:
        budget = config.host_kv_mib * MIB
        tokens, source = min(budget // (n * per_layer) for n in split) - 1, "given+config"
        if tokens < 1:
            raise ValueError(
                f"host_kv_mib {config.host_kv_mib} holds no token on a rank of {max(split)} "
                f"layers ({max(split) * per_layer} bytes per token)"
            )
    if tokens == 0:
        return 0, []
    return tokens, [Figure((tokens + 1) * n * per_layer, source) for n in split]


def with_host(plan: Plan, tokens: int, figures: list[Figure]) -> Plan:
    """The plan with its ledger's host column filled in."""
    if not figures:
        return plan
    ledger = tuple(replace(e, host=f) for e, f in zip(plan.ledger, figures, strict=True))
    return replace(plan, ledger=ledger, host_tokens=tokens)
