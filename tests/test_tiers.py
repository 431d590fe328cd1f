"""The host KV tier through the whole engine: greedy outputs equal
transformers with a device KV far smaller than the workload, at pp 1 and on
a real ring of pp 3 (also with every fourth pass voided on rank 1, which
rolls moves back); second turns of a conversation load their prefix back
from host memory; the logs replay with the spills and loads in them; a real
client sees the tier's receipts on /metrics."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.cache.tiers import TieredCache
from ringserve.replay import replay
from tests import model_factory
from tests.workloads import hf_greedy

NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
# 8 conversations of ~40 prompt tokens against 80 device slots: most of
# every turn's prefix must live in host memory between the turns
TIERED = dict(
    kv_capacity_tokens=80, host_kv_tokens=1024, chunk_size=16, max_tokens_per_pass=48, max_batch=4
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """A model, first turns, second turns (first turn + its greedy answer +
    a new message) and transformers' greedy answers to both."""
    path = model_factory.llama_gqa(tmp_path_factory.mktemp("llama"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    system = [rng.randrange(1, hf.config.vocab_size) for _ in range(20)]
    first = [system + [rng.randrange(1, hf.config.vocab_size) for _ in range(16)] for _ in range(8)]
    answers = [hf_greedy(hf, p, NEW) for p in first]
    second = [
        p + a + [rng.randrange(1, hf.config.vocab_size) for _ in range(4)]
        for p, a in zip(first, answers, strict=True)
    ]
    return path, first, answers, second, [hf_greedy(hf, p, NEW) for p in second]


def tiers_of(llm: LLM) -> TieredCache:
    cache = llm._ring.conductor.scheduler.cache
    assert isinstance(cache, TieredCache)
    return cache


def run_two_turns(llm: LLM, chats, *, all_hit: bool = True) -> None:
    _, first, answers, second, expected = chats
    outs = llm.generate(first, GREEDY)
    assert [o.token_ids for o in outs] == answers
    cache = tiers_of(llm)
    spilled, loaded = cache.spilled_tokens, cache.loaded_tokens
    assert spilled > 0, "the device never spilled to the host"
    outs = llm.generate(second, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert cache.loaded_tokens > loaded, "no second turn loaded its prefix from the host"
    # each second turn's first turn (prompt and answer but the last token) came from the cache
    assert not all_hit or all(
        o.cached_tokens >= len(p) - 5 for o, p in zip(outs, second, strict=True)
    )
    assert llm._ring.conductor.scheduler.idle


def test_two_turns_equal_transformers_with_the_host_tier_at_pp1(chats):
    with LLM(chats[0], **TIERED) as llm:
        run_two_turns(llm, chats)


def test_two_turns_equal_transformers_on_a_ring_of_three_and_replay(chats, tmp_path):
    logs = tmp_path / "logs"
    with LLM(chats[0], pp_size=3, log_dir=str(logs), passes_in_flight=3, **TIERED) as llm:
        run_two_turns(llm, chats)
    report = replay(logs)
    assert report.consistent, report.render()
    assert report.rerun.reproduced
    moves = {"spills": 0, "loads": 0}
    for line in (logs / "rank0.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "decision.made":
            for kind in moves:
                moves[kind] += len(event["decision"].get(kind, []))
    assert moves["spills"] and moves["loads"], moves


def test_the_host_tier_off_recomputes_what_it_would_have_loaded(chats):
    off = dict(TIERED, host_kv_tokens=0)
    _, first, answers, second, expected = chats
    with LLM(chats[0], **off) as llm:
        assert [o.token_ids for o in llm.generate(first, GREEDY)] == answers
        outs = llm.generate(second, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert not all(o.cached_tokens >= len(p) - 5 for o, p in zip(outs, second, strict=True))


@pytest.mark.timeout(60)
async def test_metrics_report_the_host_tier_moves_after_a_real_client_repeats_prompts():
    from openai import AsyncOpenAI

    from tests.test_http import serving

    prompts = [[10 + i] + list(range(100 + 40 * i, 130 + 40 * i)) for i in range(4)]
    async with serving(kv_capacity_tokens=64, host_kv_tokens=512, max_batch=8) as server:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for prompt in prompts + prompts:
            await client.completions.create(
                model="ringserve-builtin", prompt=prompt, max_tokens=2, temperature=0
            )
        await server.assert_no_kv_held()
        _, text = await server.get("/metrics")
        await client.close()
    values = {
        line.split()[0].removeprefix("ringserve_"): float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    cache = server.conductor.scheduler.cache
    assert values["kv_spilled_tokens_total"] == cache.spilled_tokens > 0
    assert values["kv_loaded_tokens_total"] == cache.loaded_tokens >= 3 * 30
    assert values["kv_host_hit_tokens_total"] == cache.host_hit_tokens == cache.loaded_tokens
    assert values["kv_host_slots_used"] == cache.host.used > 0
    assert values["kv_host_slots_used"] + values["kv_host_slots_free"] == 512
    assert values["kv_host_slots_capacity"] == 512
    assert values["kv_moves_rolled_back_tokens_total"] == 0
    assert "# TYPE ringserve_kv_host_slots_free gauge" in text
    assert "# TYPE ringserve_kv_spilled_tokens_total counter" in text


def test_voided_passes_roll_their_moves_back_and_outputs_stay_equal(chats, monkeypatch):
    monkeypatch.setenv("RINGSERVE_FAULTS", "void:rank=1:every=4")
    with LLM(chats[0], pp_size=3, passes_in_flight=3, **TIERED) as llm:
        run_two_turns(llm, chats, all_hit=False)  # a rolled-back spill is recomputed
        assert llm._ring.conductor.scheduler.voids > 0
        assert tiers_of(llm).rolled_back_tokens > 0, "no void met a pass that moved KV"
