"""The relief ladder (DESIGN §4): what rank 0 does when a pass cannot get
the slots it asks for, cheapest rung first. Pure Python."""

from __future__ import annotations

import structlog

from ringserve.sched.kvbook import KVBook
from ringserve.sched.passbook import Draft
from ringserve.sched.request import Request
from ringserve.sched.table import RequestTable

log = structlog.get_logger(__name__)


class Relief:
    """Rungs: evict unlocked cache (in a batch); for a running asker, retract
    the newest idle running request, its KV freed and the request requeued
    for re-prefill (possibly the asker itself, which then waits); a new
    admission that still finds no room parks (the caller's rung)."""

    def __init__(self, kv: KVBook, table: RequestTable) -> None:
        self.kv = kv
        self.table = table

    def alloc(self, n: int, draft: Draft, asker: Request | None) -> list[int] | None:
        """n slots, or None: the asker waits (it was retracted) or parks."""
        self.kv.evict_for(n)  # the cache logs asked and freed
        while asker is not None and n > self.kv.available:
            victim = self._retract_candidate(draft)
            if victim is None:
                break
            self.retract(victim)
            if victim is asker:
                return None
            if self.kv.keeps_retracted:
                self.kv.evict_for(n)  # the victim's KV went to the cache: spill it
        return self.kv.take(n)

    def _retract_candidate(self, draft: Draft) -> Request | None:
        for req in reversed(self.table.running):
            if not req.in_flight and req not in draft.reqs:
                return req
        return None

    def retract(self, req: Request) -> None:
        """Free a running request's KV and requeue it for re-prefill. With a
        host tier its KV (all confirmed: the request is idle) goes to the
        cache first, so eviction spills it and resuming it is a load."""
        if self.kv.keeps_retracted:
            self.kv.insert(req)
        log.info("request.retracted", req=req.req_id, freed=len(req.private), kept=len(req.row))
        self.kv.release(req)
        self.table.requeue(req)
