"""The memory ledger's host column: every rank's host tier holds the same
H tokens; given host memory per rank, H is what the rank with the most
layers can hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringserve.config import EngineConfig
from ringserve.models.builtin import builtin_model_dir
from ringserve.models.config import ModelConfig
from ringserve.plan.ledger import MIB
from ringserve.plan.sizing import size_ring


def test_host_mib_solves_the_tokens_the_fullest_rank_holds():
    config = EngineConfig(builtin_model_dir(), host_kv_mib=64)
    sized, plan = size_ring(config, 3, [900, 300, 300])
    per_layer = ModelConfig.from_dir(builtin_model_dir()).kv_bytes_per_token_per_layer("float32")
    most = max(plan.layer_split)
    assert sized.host_kv_tokens == 64 * MIB // (most * per_layer) - 1 == plan.host_tokens
    for entry in plan.ledger:
        assert entry.host.bytes == (sized.host_kv_tokens + 1) * len(entry.layers) * per_layer
        assert entry.host.bytes <= 64 * MIB and entry.host.source == "given+config"
    assert "host KV" in plan.table() and f"H = {plan.host_tokens} tokens" in plan.table()
    assert plan.to_dict()["ranks"][0]["host_kv"]["bytes"] == plan.ledger[0].host.bytes


def test_host_tokens_given_are_kept_and_priced_per_rank():
    sized, plan = size_ring(EngineConfig(builtin_model_dir(), host_kv_tokens=1000), 2, [900, 300])
    assert sized.host_kv_tokens == plan.host_tokens == 1000
    assert all(e.host.source == "given+config" for e in plan.ledger)
    sized, plan = size_ring(EngineConfig(builtin_model_dir()), 2, [900, 300])
    assert sized.host_kv_tokens == plan.host_tokens == 0 and "host KV" not in plan.table()


def test_host_tokens_and_mib_together_are_one_clear_cli_error():
    with pytest.raises(ValueError, match="not both"):
        size_ring(EngineConfig(builtin_model_dir(), host_kv_tokens=8, host_kv_mib=1), 1, [900])
    run = subprocess.run(
        [sys.executable, "-m", "ringserve", "plan", "--host-kv-tokens", "8", "--host-kv-mib", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "give --host-kv-tokens or --host-kv-mib, not both" in run.stderr.splitlines()[-1]
