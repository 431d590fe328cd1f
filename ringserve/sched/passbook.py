"""Rank 0's book of passes: the passes sent and not yet answered, the
micro-batch slots they hold, and the pass being drafted. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.ring.messages import Decision, Entry, NewRequest, TierCopy
from ringserve.sched.request import Request


@dataclass(slots=True)
class Pass:
    """A pass in flight: its decision and the requests it carries, in entry order."""

    decision: Decision
    reqs: list[Request]


@dataclass(slots=True)
class Draft:
    """A pass being assembled: its token budget, the requests it may still
    take (`share`), and what it holds so far. A `solo` request (one under
    suspicion after a void) rides in a pass of its own."""

    budget: int
    slot: int
    share: int
    solo: bool = False
    entries: list[Entry] = field(default_factory=list)
    reqs: list[Request] = field(default_factory=list)
    admitted: list[NewRequest] = field(default_factory=list)

    def has_room(self, max_batch: int) -> bool:
        return not self.solo and self.budget > 0 and len(self.entries) < min(max_batch, self.share)

    def takes(self, req: Request) -> bool:
        """Whether `req` may join: a solo request only an empty pass."""
        return not req.solo or not self.entries

    def add(
        self,
        req: Request,
        slots: list[int],
        reuse: list[int] | None,
        proposal: list[int] | None = None,
    ) -> None:
        """The request extends its row by `slots` in this pass (after
        taking `reuse` as its row, for an admission); the last of them, as
        many as `proposal` has tokens, hold speculative tokens to verify."""
        self.solo = req.solo
        start = len(req.row)
        k = 0 if proposal is None else len(proposal)
        tokens = req.token_range(start, start + len(slots) - k)
        sample = len(tokens) == req.pending
        masked = sample and req.params.structured_outputs is not None
        if proposal is not None:
            tokens += proposal
        self.entries.append(Entry(req.req_id, start, tokens, slots, sample, reuse, masked, k))
        self.reqs.append(req)
        self.budget -= len(slots)
        req.row.extend(slots)
        req.private.update(slots)


class PassBook:
    """Invariant: pass ids count up from 0 without a gap; `in_flight` holds
    every pass sent whose terminal is not yet applied, in pass order, at
    most one per micro-batch slot; a request dropped from the table rides
    out to every replica with the next decision."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.in_flight: dict[int, Pass] = {}
        self.next_pass_id = 0
        self._next_slot = 0
        self._to_drop: list[int] = []

    def free_slots(self) -> list[int]:
        """Slots with no pass in flight, in round-robin order from the next one."""
        busy = {p.decision.mb_slot for p in self.in_flight.values()}
        order = ((self._next_slot + k) % self.slots for k in range(self.slots))
        return [slot for slot in order if slot not in busy]

    def drop(self, req_id: int) -> None:
        """Tell every replica, with the next decision, that `req_id` is gone."""
        self._to_drop.append(req_id)

    def seal(
        self,
        draft: Draft,
        spills: list[TierCopy] | None = None,
        loads: list[TierCopy] | None = None,
    ) -> Decision:
        """Turn a non-empty draft into the next pass and mark it in flight,
        carrying the KV moves between the tiers decided with it."""
        decision = Decision(
            pass_id=self.next_pass_id,
            mb_slot=draft.slot,
            new_requests=draft.admitted,
            entries=draft.entries,
            dropped=self._to_drop,
            spills=spills if spills is not None else [],
            loads=loads if loads is not None else [],
        )
        self._to_drop = []
        self.next_pass_id += 1
        self._next_slot = (draft.slot + 1) % self.slots
        self.in_flight[decision.pass_id] = Pass(decision, draft.reqs)
        for req in draft.reqs:
            req.in_flight = True
        return decision

    def settle(self, pass_id: int) -> Pass:
        """The pass whose terminal arrived, out of flight; its requests are idle again."""
        record = self.in_flight.pop(pass_id)
        for req in record.reqs:
            req.in_flight = False
        return record
