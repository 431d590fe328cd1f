"""Rank 0's request table: every live request, the queue of those waiting
for admission and the list of those running. Pure Python."""

from __future__ import annotations

from collections import deque

import structlog

from ringserve.sched.request import Phase, Request

log = structlog.get_logger(__name__)


class RequestTable:
    """Invariant: a request is in `waiting` exactly when its phase is
    WAITING and in `running` exactly when it is RUNNING; `requests` holds
    both and the finished ones not yet forgotten."""

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def live(self) -> int:
        return len(self.running) + len(self.waiting)

    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id} is already in use")
        self.requests[req.req_id] = req
        self.waiting.append(req)
        log.info("request.admitted", req=req.req_id, prompt_tokens=len(req.prompt))

    def start(self, req: Request) -> None:
        """The head of the queue starts running."""
        assert self.waiting[0] is req
        self.waiting.popleft()
        req.phase = Phase.RUNNING
        self.running.append(req)

    def requeue(self, req: Request) -> None:
        """A running request goes back to the head of the queue."""
        self.running.remove(req)
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.phase is Phase.RUNNING:
            self.running.remove(req)
        elif req.phase is Phase.WAITING:
            self.waiting.remove(req)
        req.phase, req.finish_reason = Phase.FINISHED, reason
        log.info("request.finished", req=req.req_id, reason=reason, tokens=len(req.output))

    def forget(self, req_id: int) -> None:
        """Drop a finished request once its result is delivered."""
        req = self.requests.pop(req_id)
        if req.phase is not Phase.FINISHED:
            self.requests[req_id] = req
            raise ValueError(f"request {req_id} is still {req.phase.value}")
