"""Rank 0's heartbeat: while no pass is in flight, a `Control(HEARTBEAT)`
goes round the ring and its return is watched like any owed message, so a
ring that wedged while idle still turns health red (DESIGN §2). On its way
round every rank adds its running totals (`RankStats`), which rank 0 keeps
for /metrics."""

from __future__ import annotations

import asyncio
import time

import structlog

from ringserve.engine.metrics import RankReports
from ringserve.ring.errors import RingFailed
from ringserve.ring.messages import Control, ControlKind
from ringserve.ring.topology import RingEnds
from ringserve.ring.watchdog import Liveness, Owed, watched
from ringserve.sched.scheduler import Scheduler

log = structlog.get_logger(__name__)


class Heartbeat:
    """Invariant: at most one heartbeat is round the ring at a time, and it
    is sent only while no pass is in flight. Every Control that comes round
    is read here, at any time: a `FAILED` one (a rank found the ring out of
    step) raises `RingFailed` with its reason."""

    def __init__(
        self,
        ring: RingEnds,
        scheduler: Scheduler,
        period_s: float,
        timeout_s: float,
        health: Liveness,
        reports: RankReports | None = None,
    ) -> None:
        self.ring, self.scheduler = ring, scheduler
        self.period_s, self.timeout_s, self.health = period_s, timeout_s, health
        self.reports = reports if reports is not None else RankReports()
        self._awaited: tuple[int, asyncio.Future[None]] | None = None  # (seq, its return)

    async def run(self) -> None:
        """Until one of its two loops raises (a link failed, or the ring)."""
        tasks = [asyncio.create_task(self._beats()), asyncio.create_task(self._controls())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            # both may have ended in one step: read every exception, raise the first
            errors = [e for e in (t.exception() for t in done) if e is not None]
            if errors:
                raise errors[0]
        finally:
            for task in tasks:
                task.cancel()

    async def _beats(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.period_s)
            if self.scheduler.in_flight:
                continue
            seq += 1
            back = asyncio.get_running_loop().create_future()
            self._awaited = (seq, back)
            sent = time.monotonic()
            await self.ring.send.send(Control(ControlKind.HEARTBEAT, seq=seq))
            what = Owed(self.scheduler.next_pass_id - 1, Control, self.ring.last_rank)
            await watched(back, what, self.timeout_s, self.health)
            log.debug("heartbeat.back", seq=seq, rtt_ms=round((time.monotonic() - sent) * 1e3, 3))

    async def _controls(self) -> None:
        while True:
            msg, _ = await self.ring.inbox.get(Control)
            if msg.kind is ControlKind.FAILED:
                raise RingFailed(msg.rank, msg.reason)
            awaited = self._awaited
            if msg.kind is ControlKind.HEARTBEAT and awaited is not None and msg.seq == awaited[0]:
                self.reports.update(msg.stats)
                if not awaited[1].done():
                    awaited[1].set_result(None)
