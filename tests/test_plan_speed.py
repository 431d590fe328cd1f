"""The planner that knows speed: throughput and balanced plans checked
against brute force over every split, slow ranks given fewer layers, a
refused --min-kv-tokens, and `ringserve plan` naming the bottleneck."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ringserve.cli import main
from ringserve.config import EngineConfig
from ringserve.models.config import ModelConfig
from ringserve.plan.solve import Figure, ModelBytes, Objective, PlanError, plan, solve
from tests.test_plan import QWEN_14B, headrooms, instances, layer_figures, max_tokens, splits

SPEEDS = st.sampled_from([0.25, 0.3, 0.5, 1.0, 1.0, 1.5, 2.0, 3.0])


def head_layers(model) -> Fraction:
    """The head in mean layers of weight bytes (0 for weightless layers)."""
    layer_bytes = sum(f.bytes for f in model.layers)
    return Fraction(model.head.bytes * len(model.layers), layer_bytes) if layer_bytes else 0


def pace(split, speeds, head=0) -> Fraction:
    """The slowest stage of a split, spelled independently of the planner:
    n layers at speed s take n / s, and the last also runs the head."""
    times = [Fraction(n) / Fraction(s) for n, s in zip(split, speeds, strict=True)]
    times[-1] = (split[-1] + Fraction(head)) / Fraction(speeds[-1])
    return max(times)


def brute_paced(model, budgets, acts, page, least_tokens, cap, objective):
    """(split, T) the objective asks for, by enumeration, or the refusal."""
    lo = max(1, -(-least_tokens // page))
    head = head_layers(model)
    top_of = {}
    for split in splits(len(model.layers), len(budgets)):
        t = max_tokens(model, budgets, acts, split, page)
        top_of[split] = t if cap is None else min(t, max(lo, cap // page) * page)
    top = max(top_of.values()) // page
    if top < lo:
        return "memory"
    floor = max(lo, -(-(objective.min_kv_tokens or 0) // page))
    if objective.plan_for == "balanced":
        floor = max(floor, -(-top * 95 // 100))
    if floor > top:
        return "min_kv"
    fits = [s for s, t in top_of.items() if t >= floor * page]
    fastest = min(pace(s, objective.speeds, head) for s in fits)
    t = max(top_of[s] for s in fits if pace(s, objective.speeds, head) == fastest)
    tied = [s for s in fits if pace(s, objective.speeds, head) == fastest and top_of[s] == t]
    room = max(min(headrooms(model, budgets, acts, s, t)) for s in tied)
    return min(s for s in tied if min(headrooms(model, budgets, acts, s, t)) == room), t


@st.composite
def roomy_instances(draw):
    """Rigs that mostly fit, with capacities of hundreds of pages, where a
    few percent of T is several pages: the cases balanced plans turn on."""
    ranks = draw(st.integers(2, 4))
    layers = draw(st.lists(st.integers(0, 3000), min_size=ranks, max_size=7))
    model = ModelBytes(
        embed=Figure(draw(st.integers(0, 2000)), "config"),
        layers=layer_figures(layers),
        head=Figure(draw(st.integers(0, 2000)), "config"),
        kv_per_token_per_layer=Figure(draw(st.integers(1, 3)), "config"),
    )
    budgets = draw(st.lists(st.integers(8000, 60000), min_size=ranks, max_size=ranks))
    acts = [Figure(0, "measured")] * ranks
    return model, [Figure(b, "given") for b in budgets], acts, draw(st.sampled_from([1, 4])), 1


@settings(max_examples=500, deadline=None)
@given(st.one_of(instances(), roomy_instances()), st.data())
def test_throughput_and_balanced_plans_equal_brute_force_over_all_splits(instance, data):
    model, budgets, acts, page, least = instance
    objective = Objective(
        plan_for=data.draw(st.sampled_from(["throughput", "balanced"])),
        speeds=tuple(data.draw(st.lists(SPEEDS, min_size=len(budgets), max_size=len(budgets)))),
        min_kv_tokens=data.draw(st.one_of(st.none(), st.integers(1, 400))),
    )
    cap = data.draw(st.one_of(st.none(), st.integers(1, 3000)))
    expected = brute_paced(model, budgets, acts, page, least, cap, objective)
    kwargs = {"page_size": page, "min_capacity_tokens": least, "max_capacity_tokens": cap}
    event(expected if isinstance(expected, str) else f"{objective.plan_for} solved")
    if isinstance(expected, str):
        match = "cannot hold its slice" if expected == "memory" else "--min-kv-tokens"
        with pytest.raises(PlanError, match=match):
            solve(model, budgets, acts, objective=objective, **kwargs)
        return
    result = solve(model, budgets, acts, objective=objective, **kwargs)
    assert (result.layer_split, result.capacity_tokens) == expected
    assert result.plan_for == objective.plan_for
    assert all(e.headroom >= 0 for e in result.ledger)
    want = pace(expected[0], objective.speeds, head_layers(model))
    assert result.bottleneck.stage_time == pytest.approx(float(want))


def qwen(budgets_mib, **objective):
    return plan(
        ModelConfig.from_dict(QWEN_14B),
        pp_size=3,
        rank_memory_mib=budgets_mib,
        dtype="bfloat16",
        objective=Objective(**objective) if objective else None,
    )


def test_a_slow_rank_gets_fewer_layers_under_throughput():
    even = qwen([28000] * 3, plan_for="throughput")
    slow = qwen([28000] * 3, plan_for="throughput", speeds=(1.0, 0.5, 1.0))
    # Qwen2.5-14B's head (152k x 5120) weighs 2.83 of its layers, on the last rank
    head = 152064 * 5120 / (5120 * (2 * 5120 + 2 * 1024 + 3 * 13824) + 2 * 5120 + 2 * 1024 * 2)
    assert even.ledger[2].head_time == pytest.approx(head, rel=1e-3)
    assert even.layer_split == (17, 17, 14)  # 17, 17 and 14 + 2.83 layer times
    assert even.bottleneck.stage_time == 17.0
    assert slow.layer_split[1] < min(slow.layer_split[0], slow.layer_split[2])
    assert slow.layer_split == (20, 10, 18)  # 20 / 1, 10 / 0.5, (18 + 2.83) / 1
    assert slow.bottleneck.rank == 2
    assert slow.bottleneck.stage_time == pytest.approx(18 + head, rel=1e-4)
    capacity = qwen([28000] * 3, speeds=(1.0, 0.5, 1.0))
    assert capacity.layer_split == (16, 17, 15)  # the head weighs on the last rank
    assert capacity.bottleneck.stage_time == 34.0  # 17 layers at half speed


def test_balanced_gives_up_at_most_five_percent_of_capacity_for_a_faster_stage():
    slow = {"speeds": (1.0, 0.5, 1.0)}
    capacity = qwen([28000] * 3, **slow)
    balanced = qwen([28000] * 3, plan_for="balanced", **slow)
    fast = qwen([28000] * 3, plan_for="throughput", **slow)
    assert balanced.layer_split == (16, 16, 16)
    assert 0.95 * capacity.capacity_tokens <= balanced.capacity_tokens < capacity.capacity_tokens
    assert (
        fast.bottleneck.stage_time < balanced.bottleneck.stage_time < capacity.bottleneck.stage_time
    )
    assert fast.capacity_tokens < 0.95 * capacity.capacity_tokens


def test_on_a_big_card_beside_two_small_ones_only_throughput_unloads_the_big_card():
    # A layer moved to a 9 GB card costs it more than 5% of its KV room, so
    # balanced keeps the capacity split; throughput evens the stages out.
    capacity = qwen([28000, 9000, 9000])
    assert capacity.layer_split == (30, 10, 8) and capacity.bottleneck.rank == 0
    assert qwen([28000, 9000, 9000], plan_for="balanced").layer_split == (30, 10, 8)
    fast = qwen([28000, 9000, 9000], plan_for="throughput")
    # a 9 GB card holds 15 layers beside its activations (16 leave no room for KV)
    assert fast.layer_split == (21, 15, 12) and fast.bottleneck.stage_time == 21.0


def test_min_kv_tokens_beyond_any_split_is_refused_naming_the_shortfall():
    top = qwen([28000, 9000, 9000]).capacity_tokens
    with pytest.raises(PlanError) as info:
        qwen([28000, 9000, 9000], plan_for="throughput", min_kv_tokens=top + 100)
    message = str(info.value)
    assert f"no layer split holds --min-kv-tokens {top + 100}" in message
    assert f"the most any split holds is {top} tokens, 112 short" in message  # whole pages
    fits = qwen([28000, 9000, 9000], plan_for="throughput", min_kv_tokens=top - 16 * 1000)
    assert fits.capacity_tokens >= top - 16 * 1000


def test_engine_options_reach_the_planner_and_are_validated(tmp_path):
    from ringserve.models.builtin import builtin_model_dir
    from ringserve.plan.sizing import size_ring

    config = EngineConfig(model_dir=builtin_model_dir(), plan_for="throughput", rank_speed=[0.5, 1])
    assert config.rank_speed == (0.5, 1.0)
    sized, solved = size_ring(config, 2, [4000, 4000])
    assert solved.plan_for == "throughput" and solved.layer_split == (1, 3)
    assert sized.plan["plan_for"] == "throughput" and sized.plan["bottleneck"] == 1
    assert EngineConfig(model_dir=tmp_path).plan_for == "balanced"
    with pytest.raises(ValueError, match="plan_for must be one of"):
        EngineConfig(model_dir=tmp_path, plan_for="speed")
    with pytest.raises(ValueError, match="rank_speed must be positive"):
        EngineConfig(model_dir=tmp_path, rank_speed=(1.0, 0.0))
    with pytest.raises(ValueError, match="3 rank speeds for pp_size 2"):
        size_ring(EngineConfig(model_dir=builtin_model_dir(), rank_speed=(1, 1, 1)), 2, [4000] * 2)


def test_ringserve_plan_prints_the_stage_times_and_names_the_bottleneck(capsys):
    argv = ["plan", "--pp", "3", "--rank-memory-mib", "28000,9000,9000", "--rank-speed", "0.5,1,1"]
    assert main([*argv, "--plan-for", "throughput"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "bottleneck: rank 0, 2.00 layer-times per pass (1 layers at speed 0.5); "
        "planned for throughput"
    )
    assert "speed" in lines[-9] and "stage" in lines[-9]
    assert lines[0] == "devices: rank 0 cpu, rank 1 cpu, rank 2 cpu" or torch.cuda.is_available()
    assert main([*argv, "--plan-for", "capacity", "--min-kv-tokens", "99999999"]) == 2
    assert "no layer split holds --min-kv-tokens 99999999" in capsys.readouterr().err
