"""The host tier's figures as plain numbers for /metrics: point-in-time
gauges and the tiered cache's receipts (`cache/tiers.py`). Whatever renders
metrics reads these two dicts of name -> (value, help)."""

from __future__ import annotations

from ringserve.cache.radix import RadixCache
from ringserve.cache.tiers import TieredCache


def tier_gauges(cache: RadixCache) -> dict[str, tuple[float, str]]:
    """Point-in-time figures of the host tier, for /metrics (none without one)."""
    if not isinstance(cache, TieredCache):
        return {}
    return {
        "kv_host_slots_used": (cache.host.used, "host KV slots holding cached prefixes"),
        "kv_host_slots_free": (cache.host.available, "host KV slots free"),
        "kv_host_slots_capacity": (cache.host_capacity, "usable host KV slots"),
    }


def tier_counters(cache: RadixCache) -> dict[str, tuple[float, str]]:
    """The host tier's receipts, for /metrics (none without one)."""
    if not isinstance(cache, TieredCache):
        return {}
    return {
        "kv_spilled_tokens_total": (cache.spilled_tokens, "tokens spilled to the host tier"),
        "kv_loaded_tokens_total": (cache.loaded_tokens, "tokens loaded back from the host tier"),
        "kv_host_hit_tokens_total": (
            cache.host_hit_tokens,
            "prompt prefix tokens found in the host tier and loaded for an admission",
        ),
        "kv_host_evicted_tokens_total": (
            cache.host_evicted_tokens,
            "tokens evicted from the host tier",
        ),
        "kv_moves_rolled_back_tokens_total": (
            cache.rolled_back_tokens,
            "tokens of spills and loads rolled back by voided passes",
        ),
    }
