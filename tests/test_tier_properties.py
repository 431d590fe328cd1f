"""The host tier under random traffic: rank 0's real scheduler over a real
tiered cache, with two simulated ranks that replay every decision the way
a rank does (spills, then loads, then the forward writes its slots; a void
at some rank means no rank from it on ran the pass). A slot's content is
the token prefix whose KV it holds, so every read of every pass is checked
against what the tokens say it must be, and the census of both tiers must
balance after every step."""

from __future__ import annotations

import copy
import math
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.census import check_census, take_census
from ringserve.cache.tiers import TieredCache, prefix_cache
from ringserve.config import EngineConfig
from ringserve.engine.replica import Replica
from ringserve.params import SamplingParams
from ringserve.ring.messages import Decision, Output, Void
from ringserve.sched.request import RequestFactory
from ringserve.sched.scheduler import Scheduler, SchedulerConfig

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=8)
RANKS = 2


class SimRank:
    """One rank's KV as contents: slot -> the token prefix it holds."""

    def __init__(self) -> None:
        self.replica = Replica()
        self.device: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}

    def run(self, d: Decision, history: dict[int, list[int]]) -> None:
        rows = self.replica.apply(d)
        for c in d.spills:
            for s, h in zip(c.src, c.dst, strict=True):
                self.host[h] = self.device.get(s, ())
        for c in d.loads:
            for h, s in zip(c.src, c.dst, strict=True):
                self.device[s] = self.host.get(h, ())
        for e, row in zip(d.entries, rows, strict=True):
            tokens, slots = history[e.req_id], row.slots.tolist()
            assert tokens[e.start : e.start + len(e.tokens)] == e.tokens
            for j in range(e.start):
                got = self.device.get(slots[j])
                assert got == tuple(tokens[: j + 1]), f"pass {d.pass_id} reads stale KV at {j}"
            for j in range(e.start, e.start + len(e.tokens)):
                self.device[slots[j]] = tuple(tokens[: j + 1])


class TierTraffic(RuleBasedStateMachine):
    @initialize(capacity=st.integers(10, 40), host=st.integers(0, 40), depth=st.integers(1, 3))
    def start(self, capacity: int, host: int, depth: int) -> None:
        engine = EngineConfig(
            Path("unused"), chunk_size=4, max_tokens_per_pass=8, max_batch=4, max_retries=2
        )
        config = SchedulerConfig.from_engine(engine, model_limit=64, passes_in_flight=depth)
        alloc = SlotAllocator(capacity)
        self.sched = Scheduler(config, alloc, prefix_cache(alloc, host))
        self.factory = RequestFactory(frozenset())
        self.ranks = [SimRank() for _ in range(RANKS)]
        self.outcomes: dict[int, int | None] = {}  # pass -> the rank it voided at, or None
        self.finished: list[list[int]] = []

    @rule(prompt=TOKENS, max_tokens=st.integers(1, 4))
    def arrive(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if len(prompt) + 1 <= self.sched.allocator.capacity - 1 and len(prompt) < 64:
            self.sched.add(self.factory(prompt, params))

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), extra=TOKENS, max_tokens=st.integers(1, 4))
    def follow_up(self, data: st.DataObject, extra: list[int], max_tokens: int) -> None:
        """A second turn: an earlier request's tokens and more."""
        self.arrive(data.draw(st.sampled_from(self.finished)) + extra, max_tokens)

    @rule(rounds=st.integers(1, 12), tokens=st.lists(st.integers(0, 2), min_size=12, max_size=12))
    def pump(self, rounds: int, tokens: list[int]) -> None:
        """Schedule and answer passes for a while, none of them void."""
        for token in tokens[:rounds]:
            self.schedule(None)
            if self.sched.in_flight:
                self.terminal(token)

    @rule(void=st.none() | st.integers(0, RANKS - 1))
    def schedule(self, void: int | None) -> None:
        d = self.sched.schedule()
        if d is None:
            return
        history = {e.req_id: self.sched.requests[e.req_id].tokens for e in d.entries}
        for rank, sim in enumerate(self.ranks):
            if void is not None and rank >= void:
                sim.replica.apply(d)  # a voided pass is still applied to every replica
                continue
            sim.run(d, history)
        self.outcomes[d.pass_id] = void

    @precondition(lambda self: self.sched.in_flight)
    @rule(token=st.integers(0, 2))
    def terminal(self, token: int) -> None:
        oldest = next(iter(self.sched.in_flight))
        void = self.outcomes.pop(oldest)
        if void is not None:
            self.sched.on_void(Void(oldest, void, "injected"))
            return
        d = self.sched.in_flight[oldest].decision
        touched = self.sched.on_output(Output(oldest, [token for e in d.entries if e.sample]))
        self.finished += [r.tokens for r in touched if r.finish_reason is not None]

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.sched.running))
        self.sched.abort(req.req_id)

    @invariant()
    def census_balances_in_both_tiers(self) -> None:
        check_census(self.sched.census())

    @invariant()
    def evicting_everything_pays_what_each_tier_calls_evictable(self) -> None:
        cache = self.sched.cache
        if not isinstance(cache, TieredCache):
            return
        assert cache.host_evictable + cache.host_pinned == cache.host.used
        twin = copy.deepcopy(cache)
        assert twin.evict(math.inf) == cache.evictable_size and twin.evictable_size == 0
        evictable = twin.host_evictable
        assert twin.evict_host(math.inf) == evictable and twin.host_evictable == 0


TierTraffic.TestCase.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None, database=None
)
TestTierTraffic = TierTraffic.TestCase


def test_take_census_reads_the_host_tier():
    alloc = SlotAllocator(8)
    cache = prefix_cache(alloc, 6)
    assert isinstance(cache, TieredCache)
    cache.insert([1, 2, 3], alloc.alloc(3))
    assert cache.evict(3) == 3  # spilled, in transit until a pass carries it back
    census = take_census(alloc, cache, held_by_running=0)
    assert (census.free, census.host_free, census.host_unlocked, census.host_pinned) == (7, 3, 0, 3)
    check_census(census)
