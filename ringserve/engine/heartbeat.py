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
from ringserve.ring.messages import Control, ControlKind
from ringserve.ring.topology import RingEnds
from ringserve.ring.watchdog import Liveness, Owed, watched
from ringserve.sched.scheduler import Scheduler

log = structlog.get_logger(__name__)


class Heartbeat:
    """Invariant: at most one heartbeat is round the ring at a time, and it
    is sent only while no pass is in flight."""

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

    async def run(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.period_s)
            if self.scheduler.in_flight:
                continue
            seq += 1
            sent = time.monotonic()
            await self.ring.send.send(Control(ControlKind.HEARTBEAT, seq=seq))
            what = Owed(self.scheduler.next_pass_id - 1, Control, self.ring.last_rank)
            await watched(self._back(seq), what, self.timeout_s, self.health)
            log.debug("heartbeat.back", seq=seq, rtt_ms=round((time.monotonic() - sent) * 1e3, 3))

    async def _back(self, seq: int) -> None:
        while True:
            msg, _ = await self.ring.inbox.get(Control)
            if msg.kind is ControlKind.HEARTBEAT and msg.seq == seq:
                self.reports.update(msg.stats)
                return
