"""Rank 0's side of speculative decoding with a real allocator, radix cache
and replica: what a decode step proposes, how k follows acceptance, and
what a verification or a void does to the request's slots."""

from __future__ import annotations

from ringserve.cache.census import check_census
from ringserve.engine.replica import Replica
from ringserve.params import SamplingParams
from ringserve.ring.messages import Decision, Output, Void
from ringserve.sched.request import RequestFactory
from ringserve.sched.scheduler import Scheduler
from tests.test_scheduler import make

CYCLE = [10, 11, 12, 13, 14, 15]
PROMPT = CYCLE * 3  # the continuation of ...15 is 10, 11, ... in the history


def started(max_tokens: int = 40, **overrides) -> tuple[Scheduler, Replica]:
    """A scheduler whose one request has prefilled and taken its first token."""
    sched = make(speculative="ngram", num_speculative_tokens=4, ngram_min=1, **overrides)
    req = RequestFactory(frozenset())(
        PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    sched.add(req)
    replica = Replica()
    prefill = sched.schedule()
    replica.apply(prefill)
    sched.on_output(Output(prefill.pass_id, [10]))
    return sched, replica


def step(sched: Scheduler, replica: Replica, yields: int) -> Decision:
    """One decode step whose verification yields `yields` tokens that
    continue the cycle (the accepted proposals and one more)."""
    d = sched.schedule()
    assert d is not None
    rows = replica.apply(d)
    (entry,) = d.entries
    req = sched.requests[entry.req_id]
    assert rows[0].slots.tolist() == req.row and len(entry.slots) == entry.draft + 1
    nxt = req.tokens[-1]
    tokens = [CYCLE[(CYCLE.index(nxt) + 1 + j) % len(CYCLE)] for j in range(yields)]
    sched.on_output(Output(d.pass_id, tokens, accepted=[yields]))
    check_census(sched.census())
    if req.finish_reason is None:
        assert req.pending == 1 and len(req.row) == len(req.tokens) - 1
    return d


def test_a_decode_step_proposes_what_followed_in_the_history():
    sched, replica = started()
    d = sched.schedule()
    (entry,) = d.entries
    assert entry.draft == 4 and entry.tokens == [10, 11, 12, 13, 14]
    assert entry.sample and len(entry.slots) == 5


def test_rejected_positions_free_their_slots_and_the_row_keeps_the_rest():
    sched, replica = started()
    req = next(iter(sched.requests.values()))
    free_before = sched.allocator.available
    d = step(sched, replica, yields=2)  # one proposal accepted, three rejected
    assert sched.speculation.stats.freed == 3
    assert sched.allocator.available == free_before - 2
    assert req.row[-2:] == d.entries[0].slots[:2]
    # the next pass cuts the replica's row back to what rank 0 kept
    nxt = sched.schedule()
    replica.apply(nxt)
    assert replica.rows[req.req_id].slots.tolist() == req.row


def test_k_grows_when_all_are_accepted_and_shrinks_when_few_are():
    sched, replica = started(max_tokens=200)

    def drafts(*yields: int) -> list[int]:
        return [step(sched, replica, y).entries[0].draft for y in yields]

    assert drafts(5) == [4]  # all 4 accepted: k stays at its cap
    assert drafts(2, 1) == [4, 2]  # 1 of 4 accepted -> k = 2; 0 of 2 -> k = 1
    assert drafts(1) == [1]  # 0 of 1: back off one step
    assert drafts(1, 1) == [0, 1]  # the step without, then a try that fails: two steps
    assert drafts(1, 1, 2) == [0, 0, 1]  # ... and a try that succeeds: k grows again
    assert drafts(1, 1) == [2, 1]  # no back-off left; 0 of 2 -> k = 1


def test_without_adaptation_k_stays_fixed():
    sched, replica = started(max_tokens=200, speculative_adaptive=False)
    drafts = [step(sched, replica, yields=1).entries[0].draft for _ in range(6)]
    assert drafts == [4] * 6


def test_proposals_never_pass_max_tokens():
    sched, replica = started(max_tokens=4)
    assert step(sched, replica, yields=3).entries[0].draft == 2  # 1 + 2 + ... = 4 tokens
    req = next(iter(sched.requests.values()))
    assert req.finish_reason == "length" and len(req.output) == 4
    check_census(sched.census())


def test_a_void_rolls_the_verification_back_and_the_step_repeats():
    sched, replica = started()
    req = next(iter(sched.requests.values()))
    row, free = list(req.row), sched.allocator.available
    d = sched.schedule()
    replica.apply(d)
    sched.on_void(Void(d.pass_id, 1, "injected"))
    assert req.row == row and sched.allocator.available == free
    again = sched.schedule()
    assert again.entries[0].tokens == d.entries[0].tokens
    assert sched.speculation.stats.verifications == 0


def test_metrics_count_per_position():
    sched, replica = started(max_tokens=200)
    step(sched, replica, yields=3)
    stats = sched.speculation.stats
    assert stats.proposed == 4 and stats.accepted == 2
    assert stats.accepted_at[:3] == [1, 1, 0]
    assert stats.proposed_at[3] == 1


def test_per_position_counters_export_as_one_labelled_family():
    from types import SimpleNamespace

    from ringserve.http.prometheus import SERIES

    sched, replica = started(max_tokens=200)
    step(sched, replica, yields=3)
    conductor = SimpleNamespace(scheduler=sched)
    read = {s.name: s.read for s in SERIES if "spec" in s.name}
    assert read["ringserve_spec_accepted_at_position_total"](conductor)[("2",)] == 1
    assert read["ringserve_spec_proposed_at_position_total"](conductor)[("4",)] == 1
    vllm = read["ringserve:spec_decode_num_accepted_tokens_per_pos_total"](conductor)
    assert vllm[("0",)] == 1 and vllm[("1",)] == 1 and vllm[("2",)] == 0
