"""The memory planner: the split that gives every rank the same maximal token
capacity, checked against brute force over every split."""

from __future__ import annotations

import json
from itertools import combinations, pairwise, permutations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ringserve.models.config import ModelConfig
from ringserve.plan.solve import (
    Figure,
    ModelBytes,
    PlanError,
    budgets_from_mib,
    default_budgets,
    estimate_activations,
    model_bytes_from_config,
    model_bytes_from_dir,
    plan,
    solve,
)

MIB = 1 << 20

QWEN_14B = {
    "model_type": "qwen2",
    "hidden_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "intermediate_size": 13824,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}


def splits(num_layers: int, ranks: int):
    """Every split of num_layers into `ranks` contiguous slices of >= 1, in
    lexicographic order."""
    for cuts in combinations(range(1, num_layers), ranks - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(b - a for a, b in pairwise(bounds))


def rank_room(model: ModelBytes, budget, act, r: int, ranks: int, a: int, n: int, t: int) -> int:
    """Headroom of rank r of `ranks` holding layers [a, a + n), spelled
    independently of the planner."""
    need = sum(f.bytes for f in model.layers[a : a + n]) + act.bytes
    need += t * n * model.kv_per_token_per_layer.bytes
    need += model.embed.bytes if r == 0 else 0
    need += model.head.bytes if r == ranks - 1 else 0
    need -= model.tied if ranks == 1 else 0
    return budget.bytes - need


def headrooms(model: ModelBytes, budgets, acts, split, t: int) -> list[int]:
    starts = [sum(split[:r]) for r in range(len(split))]
    return [
        rank_room(model, budgets[r], acts[r], r, len(split), starts[r], n, t)
        for r, n in enumerate(split)
    ]


def max_tokens(model: ModelBytes, budgets, acts, split, page: int) -> int:
    """The largest page multiple this split fits, or -1 when none does."""
    slack = headrooms(model, budgets, acts, split, 0)
    if min(slack) < 0:
        return -1
    kv = model.kv_per_token_per_layer.bytes
    return min(s // (n * kv) for s, n in zip(slack, split, strict=True)) // page * page


def brute_best(model, budgets, acts, t: int) -> tuple[tuple[int, ...], int]:
    """The split with the largest minimum headroom at t, first in
    lexicographic order among equals, and that minimum."""
    best, best_room = None, None
    for split in splits(len(model.layers), len(budgets)):
        room = min(headrooms(model, budgets, acts, split, t))
        if best_room is None or room > best_room:
            best, best_room = split, room
    return best, best_room


def brute_least_short(model, budgets, acts, t: int) -> tuple[int, ...]:
    """Of the splits with the largest minimum headroom at t, the first in
    lexicographic order of those whose summed shortfall is least."""
    _, floor = brute_best(model, budgets, acts, t)
    best, best_short = None, None
    for split in splits(len(model.layers), len(budgets)):
        rooms = headrooms(model, budgets, acts, split, t)
        short = sum(max(0, -room) for room in rooms)
        if min(rooms) >= floor and (best_short is None or short < best_short):
            best, best_short = split, short
    return best


def qwen_14b_plan(budgets_mib):
    return plan(
        ModelConfig.from_dict(QWEN_14B), pp_size=3, rank_memory_mib=budgets_mib, dtype="bfloat16"
    )


@pytest.mark.parametrize("budgets_mib", list(dict.fromkeys(permutations([28000, 9000, 9000]))))
def test_big_rank_takes_most_layers_and_every_rank_gets_the_same_maximal_T(budgets_mib):
    result = qwen_14b_plan(budgets_mib)
    big = budgets_mib.index(28000)
    assert max(result.layer_split) == result.layer_split[big]
    assert result.layer_split[big] >= 2 * max(
        n for r, n in enumerate(result.layer_split) if r != big
    )
    cfg = ModelConfig.from_dict(QWEN_14B)
    kv = cfg.kv_bytes_per_token_per_layer("bfloat16")
    for entry, n in zip(result.ledger, result.layer_split, strict=True):
        assert entry.kv.bytes == result.capacity_tokens * n * kv
        assert entry.headroom >= 0
    model = model_bytes_from_config(cfg, "bfloat16")
    budgets = [e.budget for e in result.ledger]
    acts = [e.activations for e in result.ledger]
    over = result.capacity_tokens + result.page_size
    for split in splits(48, 3):
        assert min(headrooms(model, budgets, acts, split, over)) < 0, split
    assert result.capacity_tokens > 80_000  # vs ~16k tokens for a min-across-ranks sizing


@pytest.mark.parametrize(
    ("budgets_mib", "rank"), [((28000, 28000, 2000), 2), ((1500, 28000, 28000), 0)]
)
def test_impossible_budgets_are_refused_naming_the_rank_and_its_components(budgets_mib, rank):
    with pytest.raises(PlanError) as info:
        qwen_14b_plan(budgets_mib)
    message = str(info.value)
    assert message.startswith(f"rank {rank} cannot hold its slice")
    for part in ("needs", "budget", "weights", "KV", "activations"):
        assert part in message
    worst = info.value.shortfall
    assert worst.rank == rank and worst.headroom < 0
    assert worst.headroom == worst.budget.bytes - worst.weights.bytes - worst.kv.bytes - (
        worst.activations.bytes
    )


def test_more_ranks_than_layers_is_refused():
    cfg = ModelConfig.from_dict({**QWEN_14B, "num_hidden_layers": 2})
    with pytest.raises(PlanError, match="3 ranks for a model of 2 layers"):
        plan(cfg, pp_size=3, rank_memory_mib=[90000] * 3)


def test_ledger_adds_up_and_table_shows_provenance():
    cfg = ModelConfig.from_dict(QWEN_14B)
    measured = [Figure(400 * MIB, "measured")] * 3
    result = plan(
        cfg, pp_size=3, rank_memory_mib="28000,9000,9000", dtype="bfloat16", activations=measured
    )
    assert result.capacity_tokens % result.page_size == 0
    assert result.capacity_tokens >= 2048 + 1
    start = 0
    for entry in result.ledger:
        assert entry.layers.start == start
        start = entry.layers.stop
        parts = entry.weights.bytes + entry.kv.bytes + entry.activations.bytes
        assert entry.headroom == entry.budget.bytes - parts >= 0
    assert start == 48
    table = result.table()
    assert "given" in table and "config" in table and "measured" in table
    assert f"T = {result.capacity_tokens} tokens" in table
    assert len(table.splitlines()) == 3 + 6
    assert table.splitlines()[-1].startswith("bottleneck: rank 0, 30.00 layer-times per pass")
    as_dict = json.loads(json.dumps(result.to_dict()))
    assert as_dict["layer_split"] == list(result.layer_split)
    assert [r["headroom"] for r in as_dict["ranks"]] == [e.headroom for e in result.ledger]
    assert as_dict["totals"]["kv"] == sum(e.kv.bytes for e in result.ledger)


def test_kv_figure_is_what_the_pool_allocates():
    import torch

    from ringserve.cache.pool import KVPool

    cfg = ModelConfig.from_dict({**QWEN_14B, "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "intermediate_size": 96,
                                 "vocab_size": 128, "num_hidden_layers": 4})  # fmt: skip
    result = plan(cfg, pp_size=2, rank_memory_mib=[3, 2], max_num_tokens_per_pass=16)
    for entry in result.ledger:
        pool = KVPool(len(entry.layers), result.capacity_tokens, 2, 16, torch.float32)
        assert pool.nbytes == entry.kv.bytes


def layer_figures(sizes):
    return tuple(Figure(n, "file") for n in sizes)


@st.composite
def instances(draw):
    ranks = draw(st.integers(1, 4))
    layers = draw(st.lists(st.integers(0, 2000), min_size=ranks, max_size=7))
    embed, head = draw(st.integers(0, 800)), draw(st.integers(0, 800))
    model = ModelBytes(
        embed=Figure(embed, "config"),
        layers=layer_figures(layers),
        head=Figure(head, "config"),
        kv_per_token_per_layer=Figure(draw(st.integers(1, 12)), "config"),
        tied=draw(st.integers(0, min(embed, head))),
    )
    budget = st.one_of(st.integers(0, 40000), st.integers(4000, 40000))  # mostly ample
    budgets = [Figure(b, "given") for b in draw(st.lists(budget, min_size=ranks, max_size=ranks))]
    acts = [
        Figure(a, "measured")
        for a in draw(st.lists(st.integers(0, 300), min_size=ranks, max_size=ranks))
    ]
    return model, budgets, acts, draw(st.sampled_from([1, 4, 16])), draw(st.integers(1, 32))


@settings(max_examples=600, deadline=None)
@given(instances())
def test_solve_equals_brute_force_over_all_splits(instance):
    model, budgets, acts, page, min_tokens = instance
    floor = -(-min_tokens // page) * page
    splits_t = {
        s: max_tokens(model, budgets, acts, s, page)
        for s in splits(len(model.layers), len(budgets))
    }
    best_t = max(splits_t.values())
    event("refused" if best_t < floor else f"solved over {len(budgets)} ranks")
    if best_t < floor:
        with pytest.raises(PlanError) as info:
            solve(model, budgets, acts, page_size=page, min_capacity_tokens=min_tokens)
        split = brute_least_short(model, budgets, acts, floor)
        rooms = headrooms(model, budgets, acts, split, floor)
        assert info.value.shortfall.rank == rooms.index(min(rooms))
        assert f"there is, {list(split)}:" in str(info.value)
        assert info.value.shortfall.headroom == min(rooms) < 0
        return
    result = solve(model, budgets, acts, page_size=page, min_capacity_tokens=min_tokens)
    assert result.capacity_tokens == best_t
    split, room = brute_best(model, budgets, acts, best_t)
    assert result.layer_split == split
    assert min(e.headroom for e in result.ledger) == room >= 0
    assert [e.headroom for e in result.ledger] == headrooms(model, budgets, acts, split, best_t)


def greedy_split(model, budgets, acts, t):
    """Each rank takes as many layers as fit, leaving one per later rank."""
    split, ranks, layers = [], len(budgets), len(model.layers)
    for r in range(ranks - 1):
        a, n = sum(split), 0
        while a + n < layers - (ranks - 1 - r) and (
            rank_room(model, budgets[r], acts[r], r, ranks, a, n + 1, t) >= 0
        ):
            n += 1
        if n == 0:
            return None
        split.append(n)
    split.append(layers - sum(split))
    return tuple(split) if min(headrooms(model, budgets, acts, split, t)) >= 0 else None


def test_uneven_layers_defeat_the_greedy_but_not_the_solve():
    model = ModelBytes(
        embed=Figure(0, "file"),
        layers=layer_figures([1000, 1000, 5000, 1000]),
        head=Figure(0, "file"),
        kv_per_token_per_layer=Figure(1, "config"),
    )
    budgets = [Figure(b, "given") for b in (2100, 1100, 100_000)]
    acts = [Figure(0, "given")] * 3
    # At T = 1 rank 0 fits two layers, which leaves rank 1 the 5000-byte one.
    assert greedy_split(model, budgets, acts, 1) is None
    result = solve(model, budgets, acts, page_size=1)
    assert result.layer_split == (1, 1, 2)
    assert result.capacity_tokens == 100


def test_single_rank_stores_tied_embeddings_once():
    cfg = ModelConfig.from_dict({**QWEN_14B, "tie_word_embeddings": True})
    result = plan(cfg, pp_size=1, rank_memory_mib=[60000], dtype="bfloat16")
    model = model_bytes_from_config(cfg, "bfloat16")
    layers = sum(f.bytes for f in model.layers)
    assert result.ledger[0].weights.bytes == model.embed.bytes + layers + 2 * 5120
    two = plan(cfg, pp_size=2, rank_memory_mib=[30000, 30000], dtype="bfloat16")
    assert sum(e.weights.bytes for e in two.ledger) == model.embed.bytes + layers + model.head.bytes


def test_activation_estimate_charges_the_sampler_to_the_last_rank():
    cfg = ModelConfig.from_dict(QWEN_14B)
    first, last = (
        estimate_activations(cfg, "bfloat16", rank=r, pp_size=2, max_num_tokens_per_pass=512,
                             max_num_seqs=64)
        for r in (0, 1)
    )  # fmt: skip
    assert first.source == last.source == "config"
    width = 6 * 5120 + 2 * 5120 + 2 * 1024 + 3 * 13824 + 2 * 128
    assert first.bytes == 512 * (2 * width + 4 * (2 * 5120 + 2 * 5120))
    assert last.bytes - first.bytes == 64 * 152064 * 8
    normed = ModelConfig.from_dict({**QWEN_14B, "model_type": "qwen3"})
    assert normed.qk_norm
    with_norms = estimate_activations(normed, "bfloat16", rank=0, pp_size=2,
                                      max_num_tokens_per_pass=512)  # fmt: skip
    assert with_norms.bytes - first.bytes == 512 * 2 * (5120 + 1024)  # queries and keys normed


def test_budgets_given_and_measured():
    assert budgets_from_mib("28000,9000") == [
        Figure(28000 * MIB, "given"),
        Figure(9000 * MIB, "given"),
    ]
    measured = default_budgets(3)
    assert len(measured) == 3 and len(set(measured)) == 1
    assert measured[0].source == "measured" and measured[0].bytes > 0


TINY = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "intermediate_size": 48, "vocab_size": 97, "max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {"model_type": "llama", "num_key_value_heads": 2},
        {"model_type": "llama", "num_key_value_heads": 2, "attention_bias": True},
        {"model_type": "llama", "num_key_value_heads": 4, "tie_word_embeddings": True},
        {"model_type": "mistral", "num_key_value_heads": 2},
        {"model_type": "qwen2", "num_key_value_heads": 2},
        {"model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 16},
        {"model_type": "gpt_bigcode", "n_embd": 32, "n_layer": 3, "n_head": 4, "n_inner": 48,
         "n_positions": 64, "multi_query": True},
    ],
)  # fmt: skip
def test_config_weight_bytes_match_the_reference_modules(extra):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {**TINY, **extra}
    hf = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(hf)
    parts = {"embed": 0, "head": 0, "layers": [0] * 3}
    for name, p in module.named_parameters(remove_duplicate=False):
        if ".layers." in name or ".h." in name:
            parts["layers"][int(name.split(".")[2])] += p.numel() * 2
        elif any(k in name for k in ("embed_tokens", "wte", "wpe")):
            parts["embed"] += p.numel() * 2
        else:
            parts["head"] += p.numel() * 2
    model = model_bytes_from_config(ModelConfig.from_dict(raw), "bfloat16")
    assert model.embed.bytes == parts["embed"]
    assert [f.bytes for f in model.layers] == parts["layers"]
    assert model.head.bytes == parts["head"]
    assert model.tied == (97 * 32 * 2 if hf.tie_word_embeddings else 0)


def write_model_dir(path, raw: dict) -> None:
    """config.json and one float32 safetensors file with the tensor names and
    shapes of the reference module (a tied lm_head is not stored)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    tensors = {name: torch.zeros(p.shape) for name, p in module.named_parameters()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**raw, "torch_dtype": "float32"}))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_weight_bytes_from_file_match_what_each_stage_loads(tmp_path, tied, pp_size):
    import torch

    from ringserve.models.weights import WeightIndex

    raw = {**TINY, "model_type": "llama", "num_key_value_heads": 2, "tie_word_embeddings": tied}
    write_model_dir(tmp_path, raw)
    result = plan(tmp_path, pp_size=pp_size, rank_memory_mib=[2] * pp_size, dtype="bfloat16",
                  max_num_tokens_per_pass=16)  # fmt: skip
    cfg = ModelConfig.from_dir(tmp_path)
    index = WeightIndex.from_dir(tmp_path)
    for entry in result.ledger:
        assert entry.weights.source == "file"
        # float32 on disk, served in bfloat16: half the stored bytes
        assert entry.weights.bytes == index.stage_bytes(cfg, entry.layers, torch.bfloat16)
        assert 2 * entry.weights.bytes == index.stage_bytes(cfg, entry.layers)
    from_file = model_bytes_from_dir(tmp_path, cfg, "bfloat16")
    from_config = model_bytes_from_config(cfg, "bfloat16")
    assert [f.bytes for f in from_file.layers] == [f.bytes for f in from_config.layers]
    assert (from_file.embed.bytes, from_file.head.bytes, from_file.tied) == (
        from_config.embed.bytes, from_config.head.bytes, from_config.tied)  # fmt: skip
