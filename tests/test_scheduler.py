"""Rank 0's scheduler with a real allocator and radix cache. The model is
replaced by a deterministic token oracle: the scheduler never sees tensors,
so this drives exactly the code the engine runs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.census import check_census
from ringserve.cache.radix import RadixCache
from ringserve.config import EngineConfig
from ringserve.engine.replica import Replica
from ringserve.params import SamplingParams
from ringserve.ring.messages import Decision, Output, Void
from ringserve.sched.request import Phase, RequestFactory
from ringserve.sched.scheduler import Scheduler, SchedulerConfig


def make(
    capacity: int = 256, passes_in_flight: int = 1, busy_passes: int | None = None, **overrides
) -> Scheduler:
    engine = EngineConfig(Path("unused"), **overrides)
    cfg = SchedulerConfig.from_engine(
        engine, model_limit=1024, passes_in_flight=passes_in_flight, busy_passes=busy_passes
    )
    alloc = SlotAllocator(capacity)
    return Scheduler(cfg, alloc, RadixCache(alloc))


def oracle(decision: Decision) -> Output:
    """Token = (last input token + 1) % 97 for every sampled entry."""
    tokens = [(e.tokens[-1] + 1) % 97 for e in decision.entries if e.sample]
    return Output(decision.pass_id, tokens)


def run_all(
    sched: Scheduler, replica: Replica | None = None, max_passes: int = 10_000
) -> list[Decision]:
    decisions = []
    for _ in range(max_passes):
        d = sched.schedule()
        if d is None:
            break
        decisions.append(d)
        if replica is not None:
            rows = replica.apply(d)
            for e, row in zip(d.entries, rows, strict=True):
                assert row.slots.tolist() == sched.requests[e.req_id].row
        sched.on_output(oracle(d))
        check_census(sched.census())
    assert sched.idle, "scheduler stopped with work left"
    return decisions


def submit(sched: Scheduler, factory: RequestFactory, prompt: list[int], max_tokens: int = 4):
    req = factory(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    sched.add(req)
    return req


@pytest.fixture
def factory() -> RequestFactory:
    return RequestFactory(frozenset())


def test_generates_max_tokens_and_frees_everything(factory):
    sched = make()
    reqs = [submit(sched, factory, [1, 2, 3, i], max_tokens=5) for i in range(4)]
    run_all(sched)
    for r in reqs:
        assert r.phase is Phase.FINISHED and r.finish_reason == "length"
        assert r.output == [(r.prompt[-1] + 1 + k) % 97 for k in range(5)]
    census = sched.census()
    assert census.held_by_running == 0 and census.cached_locked == 0


def test_long_prompt_is_chunked_and_samples_only_at_its_end(factory):
    sched = make(chunk_size=8, max_tokens_per_pass=8)
    submit(sched, factory, list(range(20)), max_tokens=1)
    decisions = run_all(sched)
    chunks = [d.entries[0] for d in decisions]
    assert [len(e.tokens) for e in chunks] == [8, 8, 4]
    assert [e.start for e in chunks] == [0, 8, 16]
    assert [e.sample for e in chunks] == [False, False, True]


def test_shared_prefix_is_reused_after_the_first_request_returns(factory):
    sched = make()
    prefix = list(range(30))
    first = submit(sched, factory, prefix + [50])
    run_all(sched)
    second = submit(sched, factory, prefix + [60, 61])
    d = sched.schedule()
    entry = d.entries[0]
    assert entry.reuse is not None and len(entry.reuse) == 30
    assert entry.start == 30 and entry.tokens == [60, 61]
    assert second.cached_tokens == 30 and first.cached_tokens == 0
    sched.on_output(oracle(d))
    run_all(sched)


def test_decodes_and_new_prefills_share_one_pass(factory):
    sched = make()
    submit(sched, factory, [1, 2, 3], max_tokens=3)
    d0 = sched.schedule()
    sched.on_output(oracle(d0))
    submit(sched, factory, [9, 9, 9, 9])
    d1 = sched.schedule()
    assert [len(e.tokens) for e in d1.entries] == [1, 4]
    assert d1.entries[0].reuse is None and d1.entries[1].reuse is not None


def test_pressure_evicts_then_retracts_and_everything_finishes(factory):
    sched = make(capacity=40, chunk_size=16)
    rng = random.Random(7)
    reqs = [
        submit(sched, factory, [rng.randrange(5) for _ in range(rng.randrange(5, 14))], 12)
        for _ in range(8)
    ]
    replica = Replica()
    run_all(sched, replica)
    assert all(r.finish_reason == "length" and len(r.output) == 12 for r in reqs)


def test_retraction_reprefills_prompt_and_output(factory):
    sched = make(capacity=20, chunk_size=32)
    a = submit(sched, factory, [1] * 6, max_tokens=8)
    b = submit(sched, factory, [2] * 6, max_tokens=8)
    replica = Replica()
    decisions = run_all(sched, replica)
    assert a.output == [(1 + 1 + k) % 97 for k in range(8)]
    assert b.output == [(2 + 1 + k) % 97 for k in range(8)]
    # b was pushed out while a decoded, and re-entered with its output so far
    reentries = [
        e for d in decisions for e in d.entries if e.req_id == b.req_id and e.reuse is not None
    ]
    assert len(reentries) >= 2


def test_void_rolls_back_slots_and_retries(factory):
    sched = make()
    req = submit(sched, factory, list(range(10)), max_tokens=3)
    free_before = sched.allocator.available
    d = sched.schedule()
    sched.on_void(Void(d.pass_id, 1, "forward raised"))
    assert sched.allocator.available == free_before
    assert req.phase is Phase.WAITING and req.row == [] and req.retries == 1
    check_census(sched.census())
    run_all(sched)
    assert req.finish_reason == "length" and sched.voids == 1


def test_void_of_a_decode_truncates_the_row_to_its_start(factory):
    """Rank 0 cuts the row back at once; a replica that applied the voided
    decision gets no undo message and must come to the same row from the
    retry's self-describing entry (run_all compares them after every pass)."""
    sched, replica = make(), Replica()
    req = submit(sched, factory, [4, 5, 6], max_tokens=4)
    first = sched.schedule()
    replica.apply(first)
    sched.on_output(oracle(first))
    row = list(req.row)
    voided = sched.schedule()
    replica.apply(voided)
    assert replica.rows[req.req_id].slots.tolist() == row + voided.entries[0].slots
    sched.on_void(Void(voided.pass_id, 2, "oom"))
    assert req.row == row and req.phase is Phase.RUNNING
    run_all(sched, replica)
    assert req.output == [7, 8, 9, 10]


def test_retry_budget_exhausted_fails_the_request_with_the_reason(factory):
    sched = make(max_retries=2)
    req = submit(sched, factory, [1, 2, 3])
    for _ in range(3):
        d = sched.schedule()
        sched.on_void(Void(d.pass_id, 1, "forward raised"))
    assert req.phase is Phase.FINISHED
    assert "void on rank 1" in req.finish_reason and "forward raised" in req.finish_reason
    assert sched.schedule() is None
    check_census(sched.census())
    assert sched.census().held_by_running == 0


def test_replica_replays_decisions_after_voids_identically(factory):
    sched = make(capacity=64, chunk_size=8)
    for i in range(5):
        submit(sched, factory, [i] * (5 + 3 * i), max_tokens=6)
    replica = Replica()
    n = 0
    while (d := sched.schedule()) is not None:
        rows = replica.apply(d)
        n += 1
        if n % 4 == 0:
            sched.on_void(Void(d.pass_id, 1, "injected"))
        else:
            for e, row in zip(d.entries, rows, strict=True):
                assert row.slots.tolist() == sched.requests[e.req_id].row
            sched.on_output(oracle(d))
        check_census(sched.census())
    assert sched.idle and sched.voids > 0


def test_abort_of_a_running_request_frees_its_slots(factory):
    sched = make()
    req = submit(sched, factory, list(range(12)), max_tokens=50)
    sched.on_output(oracle(sched.schedule()))
    sched.abort(req.req_id)
    assert req.finish_reason == "abort"
    census = sched.census()
    assert census.held_by_running == 0 and census.cached_locked == 0


def test_passes_in_flight_never_hold_one_request_twice(factory):
    sched = make(passes_in_flight=3)
    for i in range(6):
        submit(sched, factory, [i, i + 1], max_tokens=3)
    live = []
    while (d := sched.schedule()) is not None:
        live.append(d)
    ids = [e.req_id for d in live for e in d.entries]
    assert len(ids) == len(set(ids)) and len(live) <= 3


def test_bad_prompts_are_refused_with_a_reason(factory):
    sched = make(capacity=16)
    with pytest.raises(ValueError, match="empty"):
        sched.add(factory([], SamplingParams()))
    with pytest.raises(ValueError, match="KV pool"):
        sched.add(factory(list(range(20)), SamplingParams()))
    assert sched.idle


def test_a_prompt_sharing_a_prefix_in_prefill_waits_for_its_kv(factory):
    sched = make()
    shared = list(range(40))
    first = submit(sched, factory, shared + [90])
    second = submit(sched, factory, shared + [91, 92])
    d0 = sched.schedule()
    assert [e.req_id for e in d0.entries] == [first.req_id]
    sched.on_output(oracle(d0))
    d1 = sched.schedule()
    entry = next(e for e in d1.entries if e.req_id == second.req_id)
    assert entry.reuse is not None and len(entry.reuse) == 40
    sched.on_output(oracle(d1))
    run_all(sched)


def test_requests_are_shared_between_micro_batch_slots(factory):
    sched = make(passes_in_flight=2)
    for i in range(8):
        submit(sched, factory, [i, 50 + i, 60 + i], max_tokens=5)
    d0, d1 = sched.schedule(), sched.schedule()
    assert sched.schedule() is None  # one pass in flight per slot
    assert {d0.mb_slot, d1.mb_slot} == {0, 1}
    assert len(d0.entries) == len(d1.entries) == 4
    assert not {e.req_id for e in d0.entries} & {e.req_id for e in d1.entries}
    sched.on_output(oracle(d1))
    d2 = sched.schedule()
    assert d2.mb_slot == d1.mb_slot and {e.req_id for e in d2.entries} == {
        e.req_id for e in d1.entries
    }
    sched.on_output(oracle(d0))
    sched.on_output(oracle(d2))
    run_all(sched)


def test_a_pass_past_the_busy_ones_opens_only_for_requests_that_would_wait() -> None:
    cfg = make(passes_in_flight=3, busy_passes=2, max_batch=32).config
    opened = {live: cfg.open_slots(live) for live in (0, 1, 32, 64, 80, 81, 96, 500)}
    assert opened == {0: 2, 1: 2, 32: 2, 64: 2, 80: 2, 81: 3, 96: 3, 500: 3}
    assert make(passes_in_flight=3, max_batch=32).config.open_slots(1) == 3  # all busy


@pytest.mark.parametrize(("live", "passes"), [(8, [4, 4]), (10, [4, 4]), (11, [4, 4, 3])])
def test_an_extra_pass_carries_waiting_requests_and_rows_stay_balanced(factory, live, passes):
    sched = make(passes_in_flight=3, busy_passes=2, max_batch=4)
    for i in range(live):
        submit(sched, factory, [i, 50 + i], max_tokens=6)
    first = sched.schedule()  # the prompts: each pass takes its share of them
    flight = [first]
    while (d := sched.schedule()) is not None:
        flight.append(d)
    assert sorted((len(d.entries) for d in flight), reverse=True) == passes
    assert len({d.mb_slot for d in flight}) == len(passes)
    for d in flight:
        sched.on_output(oracle(d))
    run_all(sched)


def test_a_fat_pass_gives_its_surplus_to_the_next_one(factory):
    """When every request of one pass finishes, the survivors are split over
    both slots instead of running as one fat pass beside an empty one."""
    sched = make(passes_in_flight=2)
    short = [submit(sched, factory, [i, 50 + i], max_tokens=1) for i in range(4)]
    long = [submit(sched, factory, [i, 70 + i], max_tokens=9) for i in range(4)]
    d0, d1 = sched.schedule(), sched.schedule()
    assert {e.req_id for e in d0.entries} == {r.req_id for r in short}
    sched.on_output(oracle(d0))  # every short request is done
    assert sched.schedule() is None  # the long ones are all in flight
    sched.on_output(oracle(d1))
    d2, d3 = sched.schedule(), sched.schedule()
    assert len(d2.entries) == len(d3.entries) == 2
    assert {d2.mb_slot, d3.mb_slot} == {0, 1}
    sched.on_output(oracle(d2))
    sched.on_output(oracle(d3))
    sizes = [len(d.entries) for d in run_all(sched)]
    assert max(sizes) <= 2, sizes
    assert all(len(r.output) == 9 for r in long)


def test_a_request_whose_passes_always_void_fails_alone(factory):
    """A void of a shared pass charges nobody and sends each of its requests
    alone; only the culprit's lone passes void again, so it alone spends its
    retries and fails, and the others finish untouched."""
    sched = make(max_retries=2)
    reqs = [submit(sched, factory, [i, 30 + i, 60 + i], max_tokens=4) for i in range(4)]
    culprit = reqs[2]
    first = sched.schedule()
    assert len(first.entries) == 4
    sched.on_void(Void(first.pass_id, 1, "forward raised"))
    assert [r.retries for r in reqs] == [0, 0, 0, 0] and all(r.solo for r in reqs)
    for _ in range(200):
        d = sched.schedule()
        if d is None:
            break
        ids = {e.req_id for e in d.entries}
        if any(r.req_id in ids and r.solo for r in reqs):
            assert len(ids) == 1, "a request under suspicion shared its pass"
        if culprit.req_id in ids:
            sched.on_void(Void(d.pass_id, 1, "forward raised"))
        else:
            sched.on_output(oracle(d))
        check_census(sched.census())
    assert sched.idle
    assert culprit.finish_reason.startswith("error") and "forward raised" in culprit.finish_reason
    assert all(r.finish_reason == "length" and len(r.output) == 4 for r in reqs if r is not culprit)
    assert not any(r.solo for r in reqs if r is not culprit)


def test_a_token_range_is_the_slice_of_the_whole_context(factory):
    req = factory([11, 12, 13, 14], SamplingParams(max_tokens=8))
    req.output.extend([21, 22, 23])
    whole = req.tokens
    for start in range(len(whole) + 2):
        for stop in range(start, len(whole) + 3):
            assert req.token_range(start, stop) == whole[start:stop], (start, stop)


def test_prompt_logprobs_of_a_cached_prompt_finish_in_a_pool_that_holds_one_copy(factory):
    """A request that asks for prompt logprobs computes its prompt again
    beside the cache's copy: it must not lock that copy while it runs, or a
    pool with room for one copy but not two retracts it and admits it again
    for ever."""
    sched = make(
        capacity=300, kv_capacity_tokens=300, max_batch=4, chunk_size=16, max_tokens_per_pass=64
    )
    prompt = [(i * 7) % 90 + 3 for i in range(173)]
    submit(sched, factory, prompt, max_tokens=20)
    run_all(sched)
    assert sched.cache.total_size >= len(prompt)  # the prompt is cached
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=2)
    req = factory(prompt, params)
    sched.add(req)
    run_all(sched, max_passes=100)
    assert req.finish_reason == "length" and len(req.output) == 5
