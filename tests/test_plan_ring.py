"""The memory planner drives a real ring: uneven budgets give an uneven
split with one capacity on every rank, and outputs still equal transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.plan.solve import PlanError
from tests import model_factory
from tests.workloads import ENGINE_OPTIONS, NEW_TOKENS, hf_greedy, reference_prompts

pytestmark = pytest.mark.timeout(240)


def test_uneven_budgets_give_an_uneven_plan_and_equal_outputs(tmp_path):
    path = model_factory.llama_deep(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = reference_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    options = {k: v for k, v in ENGINE_OPTIONS.items() if k != "kv_capacity_tokens"}
    llm = LLM(path, pp_size=3, rank_memory_mib=[900, 300, 300], **options)
    try:
        plan = llm.plan
        assert plan is not None and list(plan.layer_split) != [3, 3, 2]  # not the even split
        assert plan.layer_split[0] > max(plan.layer_split[1:])
        assert llm.config.kv_capacity_tokens == plan.capacity_tokens
        assert all(e.headroom >= 0 for e in plan.ledger)
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        )
        assert [o.token_ids for o in outs] == expected
    finally:
        procs = list(llm._ring.children.procs.values())
        llm.close()
        assert all(p.poll() is not None for p in procs)


def test_a_budget_that_cannot_hold_its_slice_is_refused_before_any_rank_starts(tmp_path):
    path = model_factory.llama_deep(tmp_path)
    with pytest.raises(PlanError, match="rank 2"):
        LLM(path, pp_size=3, rank_memory_mib=[900, 300, 1])


def test_budgets_past_this_machines_memory_are_refused_before_any_rank_starts(tmp_path):
    # on the CPU the ranks' budgets are this machine's RAM: 2 x 8 TiB is more than any has
    path = model_factory.llama_deep(tmp_path)
    with pytest.raises(PlanError, match="of this machine's memory"):
        LLM(path, pp_size=2, rank_memory_mib=[8_000_000, 8_000_000], device="cpu")


def test_a_host_tier_past_this_machines_memory_is_refused_naming_the_tier(tmp_path):
    path = model_factory.llama_deep(tmp_path)
    with pytest.raises(PlanError, match=r"memory; give a smaller host KV tier \(--host-kv-tokens"):
        LLM(path, host_kv_tokens=10**13, device="cpu")


def test_without_budgets_each_rank_gets_its_default_budget_and_the_capacity_is_capped(tmp_path):
    from ringserve.config import EngineConfig
    from ringserve.plan.sizing import size_ring

    path = model_factory.llama_deep(tmp_path)
    config, plan = size_ring(EngineConfig(model_dir=path, kv_capacity_tokens=4096), 3, None)
    assert plan is not None and all(e.budget.source == "measured" for e in plan.ledger)
    assert config.kv_capacity_tokens == plan.capacity_tokens == 4096
    assert config.layer_split == plan.layer_split and sum(plan.layer_split) == 8
    assert all(e.headroom >= 0 for e in plan.ledger)
    given, none = size_ring(EngineConfig(model_dir=path, layer_split=(2, 3, 3)), 3, None)
    assert none is None and given.layer_split == (2, 3, 3) and given.kv_capacity_tokens == 16384
