"""Fault rules from RINGSERVE_FAULTS: parsing, validation, per-rank plans."""

from __future__ import annotations

import pytest

from ringserve.ring.faults import ENV_VAR, FaultPlan, parse_rules
from ringserve.ring.messages import Decision, Hidden, Output

SPEC = "void:rank=1:every=3, drop:rank=2:kind=hidden:pass=7,crash:rank=1:pass=40,slow:rank=2:ms=25"


def test_void_every_k_marks_the_kth_passes_counting_from_zero() -> None:
    plan = FaultPlan.parse(SPEC, rank=1)
    assert [p for p in range(10) if plan.should_void(p)] == [2, 5, 8]


def test_every_one_voids_every_pass() -> None:
    plan = FaultPlan.parse("void:rank=0:every=1", rank=0)
    assert all(plan.should_void(p) for p in range(5))


def test_drop_names_one_kind_of_one_pass() -> None:
    plan = FaultPlan.parse(SPEC, rank=2)
    assert plan.should_drop(Hidden, 7)
    assert not plan.should_drop(Hidden, 8)
    assert not plan.should_drop(Decision, 7)
    assert not plan.should_drop(Output, 7)


def test_crash_and_slow_apply_to_their_rank_only() -> None:
    one, two = FaultPlan.parse(SPEC, rank=1), FaultPlan.parse(SPEC, rank=2)
    assert one.should_crash(40) and not one.should_crash(39)
    assert not two.should_crash(40)
    assert (one.slow_ms, two.slow_ms) == (0, 25)


def test_rank_without_rules_gets_an_empty_plan() -> None:
    plan = FaultPlan.parse(SPEC, rank=0)
    assert plan.empty
    assert not plan.should_void(2) and not plan.should_crash(40) and plan.slow_ms == 0
    assert not FaultPlan.parse(SPEC, rank=1).empty


def test_several_void_rules_combine() -> None:
    plan = FaultPlan.parse("void:rank=0:every=4,void:rank=0:every=6", rank=0)
    assert [p for p in range(13) if plan.should_void(p)] == [3, 5, 7, 11]


def test_plan_reads_the_environment() -> None:
    plan = FaultPlan.from_env(2, {ENV_VAR: "slow:rank=2:ms=5"})
    assert plan.slow_ms == 5
    assert FaultPlan.from_env(2, {}).empty


def test_empty_and_blank_specs_have_no_rules() -> None:
    assert parse_rules("") == ()
    assert parse_rules(" , ,") == ()


def test_plan_is_frozen() -> None:
    plan = FaultPlan.parse(SPEC, rank=2)
    with pytest.raises(AttributeError):
        plan.slow_ms = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("explode:rank=1", "unknown action 'explode'"),
        ("void:rank=1", "missing every"),
        ("drop:rank=1:kind=hidden", "missing pass"),
        ("void:rank=1:every=3:ms=4", "bad field 'ms=4'"),
        ("void:rank=1:rank=2:every=3", "bad field 'rank=2'"),
        ("void:rank=1:every", "bad field 'every'"),
        ("void:rank=one:every=3", "rank must be an integer, got 'one'"),
        ("void:rank=-1:every=3", "rank must be at least 0, got -1"),
        ("void:rank=1:every=0", "every must be at least 1, got 0"),
        ("slow:rank=1:ms=-5", "ms must be at least 0, got -5"),
        ("slow:rank=1", "missing ms or ms_per_layer"),
        ("slow:rank=1:ms=2:ms_per_layer=3", "missing ms or ms_per_layer"),
        ("slow:rank=1:ms_per_layer=-1", "ms_per_layer must be at least 0, got -1"),
        ("drop:rank=1:kind=logits:pass=2", "kind must be one of decision, hidden, output"),
    ],
)
def test_bad_rule_is_refused_naming_the_rule_and_the_fault(spec: str, complaint: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_rules(f"slow:rank=0:ms=1,{spec}")
    assert f"fault rule {spec!r}" in str(caught.value)
    assert complaint in str(caught.value)


def test_bad_rule_for_another_rank_still_fails_every_rank() -> None:
    with pytest.raises(ValueError, match="every must be at least 1"):
        FaultPlan.parse("void:rank=2:every=0", rank=0)


def test_two_slow_rules_for_one_rank_are_refused() -> None:
    with pytest.raises(ValueError, match="give rank 1 2 slow rules; give it one"):
        FaultPlan.parse("slow:rank=1:ms=5,slow:rank=1:ms=9", rank=1)


def test_slow_per_layer_sleeps_in_proportion_to_the_layers_held() -> None:
    plan = FaultPlan.parse("slow:rank=1:ms_per_layer=4", rank=1)
    assert not plan.empty and plan.slow_ms == 0
    assert plan.slow_s(3) == pytest.approx(0.012)
    assert plan.slow_s(1) == pytest.approx(0.004)
    flat = FaultPlan.parse("slow:rank=1:ms=25", rank=1)
    assert flat.slow_s(1) == flat.slow_s(7) == pytest.approx(0.025)
    assert FaultPlan.parse("", rank=1).slow_s(5) == 0


def test_rules_that_can_never_fire_on_the_ring_are_named() -> None:
    from ringserve.ring.faults import never_fire

    spec = (
        "drop:rank=1:kind=hidden:pass=3,drop:rank=0:kind=output:pass=1,"
        "crash:rank=5:pass=2,drop:rank=1:kind=output:pass=2,drop:rank=0:kind=hidden:pass=1"
    )
    said = never_fire(spec, 2)
    assert said == [
        "drop:rank=1:kind=hidden:pass=3: the last rank sends no hidden "
        "(it sends output, void, control)",
        "drop:rank=0:kind=output:pass=1: rank 0 sends no output (it sends decision, hidden, control)",
        "crash:rank=5:pass=2: a ring of 2 ranks has no rank 5",
    ]
    assert never_fire("drop:rank=0:kind=decision:pass=0", 1) == [
        "drop:rank=0:kind=decision:pass=0: a ring of one rank sends no messages"
    ]
    assert never_fire("drop:rank=1:kind=hidden:pass=3,void:rank=2:every=5", 3) == []


def test_launch_says_which_rules_can_never_fire() -> None:
    from tests.test_cli_errors import run_cli

    # a split that does not fit ends the launch right after the check, before any rank starts
    code, err = run_cli(
        ["launch", "--pp", "2", "--layer-split", "9,9"],
        env={ENV_VAR: "drop:rank=1:kind=hidden:pass=3"},
    )
    assert code == 2, err
    assert (
        "RINGSERVE_FAULTS: this rule can never fire: drop:rank=1:kind=hidden:pass=3: the last "
        "rank sends no hidden" in err
    ), err
