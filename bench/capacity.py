"""KV token capacity on uneven rigs: ringserve's plan against min-across-ranks sizing.

    .venv/bin/python bench/capacity.py [--ledger]

For each rig and model (bf16 weights and KV), two sizings of the same budgets:

  ringserve  `plan()`: the layer split chosen so that every rank holds the
             same, largest, token capacity T.
  min        what engines that reduce free memory or KV blocks to the minimum
             across ranks do: an even layer split (L // R layers per rank, the
             remainder to the first ranks) and every rank's pool set to the
             smallest capacity any rank's budget allows. 0 when some rank
             cannot even hold its even share of the weights.

Budgets: a card of G GB is taken as G GiB less the reserve `default_budgets`
keeps on CUDA (max(1 GiB, 1/20 of the card)), the same for both sizings.
Weights: parameter counts from the config. Activations: the fixed config
estimate of `estimate_activations` for passes of 2048 tokens and 256 sampled
rows (the `plan()` defaults), the same figure in both sizings. Capacities are
rounded down to 16-token pages in both.
"""

from __future__ import annotations

import argparse
import logging

import structlog

from ringserve.models.config import ModelConfig
from ringserve.plan.ledger import CUDA_RESERVE_FRACTION, CUDA_RESERVE_MIN
from ringserve.plan.solve import (
    PlanError,
    estimate_activations,
    model_bytes_from_config,
    plan,
)

MIB = 1 << 20
GIB = 1 << 30
PAGE = 16
TOKENS_PER_PASS = 2048
DTYPE = "bfloat16"

MODELS = {
    "Llama-3.1-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen2.5-14B": {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "intermediate_size": 13824,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}

RIGS = {"32+10+10": (32, 10, 10), "24+12": (24, 12), "80+40+40+24": (80, 40, 40, 24)}


def budget_mib(card_gb: int) -> int:
    card = card_gb * GIB
    return (card - max(CUDA_RESERVE_MIN, card // CUDA_RESERVE_FRACTION)) // MIB


def even_split(num_layers: int, ranks: int) -> list[int]:
    base, extra = divmod(num_layers, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def min_sizing(cfg: ModelConfig, budgets_mib: list[int]) -> int:
    """Even split, every rank's pool the minimum any rank's budget allows."""
    model = model_bytes_from_config(cfg, DTYPE)
    kv = model.kv_per_token_per_layer.bytes
    ranks, allowed, start = len(budgets_mib), [], 0
    for r, n in enumerate(even_split(cfg.num_layers, ranks)):
        weights = sum(f.bytes for f in model.layers[start : start + n])
        weights += model.embed.bytes if r == 0 else 0
        weights += model.head.bytes if r == ranks - 1 else 0
        act = estimate_activations(
            cfg, DTYPE, rank=r, pp_size=ranks, max_num_tokens_per_pass=TOKENS_PER_PASS
        )
        allowed.append((budgets_mib[r] * MIB - weights - act.bytes) // (n * kv))
        start += n
    return max(0, min(allowed) // PAGE * PAGE)


def ringserve_sizing(cfg: ModelConfig, budgets_mib: list[int]):
    try:
        return plan(
            cfg,
            pp_size=len(budgets_mib),
            rank_memory_mib=budgets_mib,
            max_num_tokens_per_pass=TOKENS_PER_PASS,
            dtype=DTYPE,
            page_size=PAGE,
        )
    except PlanError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", action="store_true", help="print each plan's ledger")
    args = parser.parse_args()
    # the table below is the report; the planner's own log events would bury it
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    header = f"{'model':<13} {'rig (GB)':<12} {'split':<16} {'ringserve T':>11} {'min T':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for name, raw in MODELS.items():
        cfg = ModelConfig.from_dict(raw)
        for rig, cards in RIGS.items():
            budgets = [budget_mib(g) for g in cards]
            result, baseline = ringserve_sizing(cfg, budgets), min_sizing(cfg, budgets)
            ours = result.capacity_tokens if result is not None else 0
            split = ",".join(map(str, result.layer_split)) if result is not None else "no fit"
            ratio = f"{ours / baseline:.2f}" if baseline else ("inf" if ours else "-")
            print(f"{name:<13} {rig:<12} {split:<16} {ours:>11} {baseline:>8} {ratio:>6}")
            if args.ledger and result is not None:
                print(result.table(), end="\n\n")


if __name__ == "__main__":
    main()
