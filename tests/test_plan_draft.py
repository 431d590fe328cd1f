"""The draft model of `--speculative draft` in rank 0's memory plan: its
weights, its KV pool of T tokens and its activations are charged to rank 0
(checked against brute force over every split), shown in the ledger, refused
by name when they cannot fit, and audited at boot against what a real ring
allocates."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ringserve import LLM, SamplingParams
from ringserve.models.config import ModelConfig
from ringserve.plan.draft import DraftBytes, draft_bytes_from_dir
from ringserve.plan.solve import Figure, PlanError, model_bytes_from_config, solve
from tests import model_factory
from tests.test_plan import MIB, QWEN_14B, instances, splits

pytestmark = pytest.mark.timeout(120)

GIB = 1 << 30


def draft_room(draft: DraftBytes | None, r: int, t: int) -> int:
    """What the draft takes from rank r at capacity t, spelled independently."""
    if draft is None or r != 0:
        return 0
    return draft.weights.bytes + t * draft.kv_per_token.bytes + draft.activations.bytes


def rooms(model, budgets, acts, draft, split, t: int) -> list[int]:
    """Every rank's headroom holding `split` at t, the draft on rank 0."""
    out, a = [], 0
    for r, n in enumerate(split):
        need = sum(f.bytes for f in model.layers[a : a + n]) + acts[r].bytes
        need += t * n * model.kv_per_token_per_layer.bytes
        need += model.embed.bytes if r == 0 else 0
        need += model.head.bytes if r == len(split) - 1 else 0
        need -= model.tied if len(split) == 1 else 0
        out.append(budgets[r].bytes - need - draft_room(draft, r, t))
        a += n
    return out


def split_tokens(model, budgets, acts, draft, split, page: int) -> int:
    """The largest page multiple `split` fits, or -1 when none does: each
    rank's slack at T = 0 over what one more token costs it."""
    slack = rooms(model, budgets, acts, draft, split, 0)
    if min(slack) < 0:
        return -1
    kv = model.kv_per_token_per_layer.bytes
    cost = [n * kv + (draft.kv_per_token.bytes if r == 0 else 0) for r, n in enumerate(split)]
    return min(s // c for s, c in zip(slack, cost, strict=True)) // page * page


def brute(model, budgets, acts, draft, page: int, floor: int) -> tuple[int, tuple, int]:
    """The largest page multiple T >= floor some split fits (-1: none), the
    lexicographically first split with the largest minimum headroom there
    (and, of those, the least summed shortfall), and that minimum; at floor
    when nothing fits."""
    all_splits = list(splits(len(model.layers), len(budgets)))
    best_t = max(split_tokens(model, budgets, acts, draft, s, page) for s in all_splits)
    best_t = best_t if best_t >= floor else -1
    at = best_t if best_t >= 0 else floor

    def rank(s: tuple[int, ...]) -> tuple[int, int]:
        headroom = rooms(model, budgets, acts, draft, s, at)
        return min(headroom), -sum(max(0, -room) for room in headroom)

    split = max(all_splits, key=rank)
    return best_t, split, min(rooms(model, budgets, acts, draft, split, at))


@st.composite
def with_draft(draw):
    model, budgets, acts, page, min_tokens = draw(instances())
    draft = DraftBytes(
        weights=Figure(draw(st.integers(0, 3000)), "file"),
        kv_per_token=Figure(draw(st.integers(1, 24)), "config"),
        activations=Figure(draw(st.integers(0, 300)), "config"),
    )
    return model, budgets, acts, draft, page, min_tokens


@settings(max_examples=300, deadline=None)
@given(with_draft())
def test_solve_with_a_draft_equals_brute_force_over_all_splits(instance):
    model, budgets, acts, draft, page, min_tokens = instance
    floor = -(-min_tokens // page) * page
    best_t, split, room = brute(model, budgets, acts, draft, page, floor)
    event("refused" if best_t < 0 else f"solved over {len(budgets)} ranks")
    if best_t < 0:
        with pytest.raises(PlanError) as info:
            solve(model, budgets, acts, page_size=page, min_capacity_tokens=min_tokens, draft=draft)
        worst = info.value.shortfall
        assert worst.headroom == room < 0
        assert worst.rank == rooms(model, budgets, acts, draft, split, floor).index(room)
        assert (worst.draft is not None) == (worst.rank == 0)
        return
    result = solve(
        model, budgets, acts, page_size=page, min_capacity_tokens=min_tokens, draft=draft
    )
    assert result.capacity_tokens == best_t
    assert result.layer_split == split
    assert [e.headroom for e in result.ledger] == rooms(model, budgets, acts, draft, split, best_t)
    entry = result.ledger[0].draft
    assert entry is not None and entry.kv.bytes == best_t * draft.kv_per_token.bytes
    assert all(e.draft is None for e in result.ledger[1:])


# a draft of about 1.5 B parameters in bfloat16 beside Qwen 14B
QWEN_DRAFT = DraftBytes(
    weights=Figure(3 * GIB, "file"),
    kv_per_token=Figure(28 * 2 * 2 * 256 * 2, "config"),  # 28 layers, K and V, 2 heads of 256
    activations=Figure(200 * MIB, "config"),
)


def qwen_solve(budgets_mib, draft):
    model = model_bytes_from_config(ModelConfig.from_dict(QWEN_14B), "bfloat16")
    budgets = [Figure(b * MIB, "given") for b in budgets_mib]
    acts = [Figure(400 * MIB, "measured")] * len(budgets)
    return solve(model, budgets, acts, min_capacity_tokens=2049, draft=draft)


def test_the_draft_takes_rank_0s_room_for_target_layers_and_shows_in_its_row_only():
    plain = qwen_solve([28000, 9000, 9000], None)
    drafted = qwen_solve([28000, 9000, 9000], QWEN_DRAFT)
    assert drafted.layer_split[0] < plain.layer_split[0]
    assert drafted.capacity_tokens < plain.capacity_tokens
    zero = drafted.ledger[0]
    assert zero.draft is not None and zero.draft.weights.bytes == 3 * GIB
    assert zero.draft.kv.bytes == drafted.capacity_tokens * QWEN_DRAFT.kv_per_token.bytes
    parts = zero.weights.bytes + zero.kv.bytes + zero.activations.bytes + zero.draft.total
    assert zero.headroom == zero.budget.bytes - parts >= 0
    table = drafted.table().splitlines()
    assert table[0].split()[-1] == "draft"
    assert table[2].endswith(f"{zero.draft.total / MIB:.1f} file+config")
    assert table[3].endswith(" -") and table[4].endswith(" -")
    assert any(line.startswith("draft on rank 0: weights 3072.0 file") for line in table)
    as_dict = json.loads(json.dumps(drafted.to_dict()))
    assert as_dict["ranks"][0]["draft"]["kv"] == zero.draft.kv.to_dict()
    assert "draft" not in as_dict["ranks"][1] and as_dict["totals"]["draft"] == zero.draft.total
    assert "draft" not in plain.table() and "draft" not in plain.to_dict()["totals"]


def test_a_draft_rank_0_cannot_hold_is_refused_naming_it():
    qwen_solve([12000, 28000, 28000], None)  # fits without the draft
    with pytest.raises(PlanError) as info:
        qwen_solve([12000, 28000, 28000], replace(QWEN_DRAFT, weights=Figure(12 * GIB, "file")))
    message, worst = str(info.value), info.value.shortfall
    assert message.startswith("rank 0 cannot hold its slice")
    assert worst.rank == 0 and worst.draft is not None and worst.headroom < 0
    kv = worst.draft.kv.bytes
    assert kv == 2064 * QWEN_DRAFT.kv_per_token.bytes  # 2049 tokens, rounded up to a page
    assert "draft 12.3 GiB (weights 12.0 GiB, KV 112.9 MiB, activations 200.0 MiB)" in message
    assert message.endswith("or a smaller draft model")
    parts = worst.weights.bytes + worst.kv.bytes + worst.activations.bytes + worst.draft.total
    assert worst.headroom == worst.budget.bytes - parts


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    target = model_factory.llama_copy(tmp)
    draft = model_factory.llama_copy(
        tmp, "draft", hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, scramble=0.3
    )
    return target, draft


def test_draft_figures_from_file_are_its_parameters_and_config(pair):
    _, draft = pair
    figures = draft_bytes_from_dir(draft, "float32", max_num_tokens_per_pass=48, max_num_seqs=8)
    vocab, hidden, inter = 256, 32, 64
    layer = 2 * hidden * hidden + 2 * hidden * 16 + 3 * hidden * inter + 2 * hidden
    assert figures.weights.bytes == 4 * (2 * vocab * hidden + layer + hidden)
    assert figures.kv_per_token.bytes == 2 * 16 * 4  # one layer, K and V, one head of 16


def test_a_ring_with_a_draft_allocates_what_rank_0s_ledger_planned(pair, tmp_path):
    target, draft = pair
    options = dict(chunk_size=16, max_tokens_per_pass=48, max_batch=8, num_speculative_tokens=3)
    llm = LLM(
        target,
        pp_size=2,
        rank_memory_mib=[3, 2],
        log_dir=str(tmp_path),
        speculative="draft",
        draft_model=str(draft),
        **options,
    )
    try:
        zero = llm.plan.ledger[0].draft
        assert zero is not None and zero.kv.bytes > 0
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = llm.generate([[5, 6, 7, 8, 9, 10]], params)
        assert len(outs[0].token_ids) == 8
    finally:
        llm.close()
    events = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    audits = [e for e in events if e["event"] == "plan.allocated" and "draft_kv" in e["actual"]]
    assert len(audits) == 1
    planned, actual = audits[0]["planned"], audits[0]["actual"]
    assert planned["draft_weights"] == actual["draft_weights"] == zero.weights.bytes
    assert planned["draft_kv"] == actual["draft_kv"] == zero.kv.bytes
    assert 0 <= actual["draft_activations"] <= planned["draft_activations"]
    unforeseen = [e["part"] for e in events if e["event"] == "plan.unforeseen"]
    assert unforeseen == [], unforeseen


@pytest.mark.parametrize("planned", [True, False])
def test_the_boot_audit_reports_a_draft_the_plan_left_out(pair, planned):
    from structlog.testing import capture_logs

    from ringserve.config import EngineConfig
    from ringserve.launch.boot import build_drafter
    from ringserve.plan.sizing import size_ring

    target, draft = pair
    config = EngineConfig(
        model_dir=target, max_tokens_per_pass=48, max_batch=8,
        draft_model=draft if planned else None, speculative="draft" if planned else "ngram",
    )  # fmt: skip
    sized, _ = size_ring(config, 1, [3])
    with capture_logs() as logs:
        drafting = replace(sized, speculative="draft", draft_model=draft)
        build_drafter(drafting, ModelConfig.from_dir(target))
    unforeseen = {e["part"] for e in logs if e["event"] == "plan.unforeseen"}
    if planned:  # the CPU's activation figure is a resident-set rise: noisy, so not pinned
        assert unforeseen <= {"draft_activations"}
    else:  # the activation peak is measured too, but on the CPU it may rise by nothing
        assert {"draft_weights", "draft_kv"} <= unforeseen <= {f"draft_{p}" for p in PARTS}


PARTS = ("weights", "kv", "activations")
