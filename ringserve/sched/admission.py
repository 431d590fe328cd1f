"""Which waiting requests a pass admits, and with which cached prefix.
Pure Python."""

from __future__ import annotations

import structlog

from ringserve.ring.messages import NewRequest
from ringserve.sched.kvbook import KVBook
from ringserve.sched.passbook import Draft
from ringserve.sched.relief import Relief
from ringserve.sched.request import Request
from ringserve.sched.spill import borrow_prefix
from ringserve.sched.table import RequestTable

log = structlog.get_logger(__name__)

# A waiting request whose prompt shares at least this many more tokens with
# a prompt still being prefilled waits for that prefill to reach the cache.
SHARED_PREFIX_MIN = 16


class Admission:
    """Admits from the head of the queue, in arrival order, while the pass
    has room: a request that must wait for a shared prefix, or that finds no
    slots, stops admission for this pass (no overtaking)."""

    def __init__(
        self, table: RequestTable, kv: KVBook, relief: Relief, chunk_size: int, max_batch: int
    ) -> None:
        self.table, self.kv, self.relief = table, kv, relief
        self.chunk_size, self.max_batch = chunk_size, max_batch

    def fill(self, draft: Draft) -> None:
        """Admit waiting requests into `draft` while it has room."""
        while self.table.waiting and draft.has_room(self.max_batch):
            req = self.table.waiting[0]
            if not draft.takes(req):
                return
            found = self.kv.match(req)
            cached = len(found.slots) + found.host_tokens
            if self._prefix_pending(req, cached):
                log.debug("request.deferred", req=req.req_id, cached=cached)
                return
            limit = min(self.chunk_size, draft.budget)
            taken = borrow_prefix(self.kv, self.relief, req, found, limit, draft)
            if taken is None:
                log.info(
                    "request.parked", req=req.req_id, needs=min(len(req.tokens) - cached, limit)
                )
                return
            reuse, slots = taken
            self.table.start(req)
            req.row = list(reuse)
            if not req.admitted:  # after a retraction the reuse is its own prompt and output
                req.cached_tokens, req.admitted = min(len(reuse), len(req.prompt)), True
            history = req.tokens[: len(reuse)] if req.spec.needs_history else None
            draft.admitted.append(NewRequest(req.req_id, req.spec, history))
            draft.add(req, slots, reuse)

    def _prefix_pending(self, req: Request, cached: int) -> bool:
        """Whether a request whose prompt is not yet cached shares more of it than
        the cache holds: waiting one pass for its KV beats computing it twice."""
        if not self.kv.prefix_reuse:
            return False
        tokens, need = req.tokens, cached + SHARED_PREFIX_MIN
        return any(
            not other.output and _common_prefix(other.prompt, tokens, need) >= need
            for other in self.table.running
        )


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, counted up to `limit`."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
