"""Rank 0's scheduler with a host tier and a token oracle: a retracted
request's KV is spilled, and resuming it is a load, not a recompute."""

from __future__ import annotations

from pathlib import Path

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.census import check_census
from ringserve.cache.tiers import prefix_cache
from ringserve.config import EngineConfig
from ringserve.params import SamplingParams
from ringserve.ring.messages import Decision, Output
from ringserve.sched.request import RequestFactory
from ringserve.sched.scheduler import Scheduler, SchedulerConfig


def make(capacity: int, host: int) -> Scheduler:
    engine = EngineConfig(Path("unused"), chunk_size=16, max_tokens_per_pass=32)
    cfg = SchedulerConfig.from_engine(engine, model_limit=1024, passes_in_flight=1)
    alloc = SlotAllocator(capacity)
    return Scheduler(cfg, alloc, prefix_cache(alloc, host))


def run(sched: Scheduler) -> list[Decision]:
    decisions = []
    while (d := sched.schedule()) is not None:
        decisions.append(d)
        tokens = [(e.tokens[-1] + 1) % 97 for e in d.entries if e.sample]
        sched.on_output(Output(d.pass_id, tokens))
        check_census(sched.census())
    assert sched.idle
    return decisions


def two_long_decodes(host: int) -> tuple[Scheduler, list[Decision], list[list[int]]]:
    """Two requests whose decodes cannot both fit 23 device slots."""
    sched = make(capacity=24, host=host)
    new = RequestFactory(frozenset())
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reqs = [new([1 + i] * 8, params) for i in range(2)]
    for req in reqs:
        sched.add(req)
    decisions = run(sched)
    # The prompts share nothing: a retracted request resuming from what it
    # computed itself (its prompt and output, kept by the tier) found none of
    # its prompt cached (that count exceeded the prompt before).
    assert [r.cached_tokens for r in reqs] == [0, 0]
    return sched, decisions, [r.output for r in reqs]


def test_a_retracted_request_resumes_by_loading_its_kv_not_recomputing():
    _, plain, expected = two_long_decodes(host=0)
    sched, decisions, outputs = two_long_decodes(host=64)
    assert outputs == expected
    # without the tier the retracted request is prefilled again from scratch
    assert sum(1 for d in plain for e in d.entries if e.reuse == [] and e.req_id == 1) == 2
    readmitted = [(d, e) for d in decisions for e in d.entries if e.reuse is not None][2:]
    assert readmitted, "nothing was retracted"
    for d, e in readmitted:
        assert d.loads, "the resumed request did not load its KV back"
        assert e.start >= 8 and len(e.tokens) == 1, "the resumed request recomputed its KV"
    assert sched.cache.spilled_tokens >= 8 and sched.cache.loaded_tokens >= 8
