"""Where a rank sits in the ring, and its two links: the link to its
successor and the link from its predecessor, each on the tag of its
sending rank."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ringserve.ring.announce import Expectation
from ringserve.ring.faults import FaultPlan, FaultySend
from ringserve.ring.inbox import Inbox
from ringserve.ring.messages import Control, ControlKind
from ringserve.ring.recv_link import RecvLink
from ringserve.ring.send_link import SendLink

MAX_IN_FLIGHT = 8


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Where one rank sits in the ring."""

    rank: int
    world: int
    master_addr: str
    master_port: int

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


@dataclass(slots=True)
class RingEnds:
    """One rank's ends of the ring: the link to its successor, the link from
    its predecessor, and the inbox that link feeds."""

    inbox: Inbox
    send: SendLink | FaultySend
    recv: RecvLink
    last_rank: int


def open_links(spec: RankSpec, faults: FaultPlan, expect: Expectation | None = None) -> RingEnds:
    """This rank's two links, each on the tag of its sending rank, with the
    rank's link faults applied. Call on the rank's event loop. `expect`, the
    same on every rank, lets a Decision announce its Hidden's tensors
    (`ring/announce.py`)."""
    if faults.ring_drops:
        expect = None
    inbox = Inbox()
    recv = RecvLink(spec.prev, spec.prev, inbox, expect=expect)
    send = SendLink(spec.next, spec.rank, MAX_IN_FLIGHT, inbox=inbox, expect=expect)
    return RingEnds(inbox, faults.wrap(send), recv, spec.world - 1)


async def announce_ready(ends: RingEnds, timeout_s: float) -> None:
    """Rank 0: send READY round the ring and wait for it to come back, which
    it does only once every rank has loaded its slice and opened its links."""
    await ends.send.send(Control(ControlKind.READY))
    async with asyncio.timeout(timeout_s):
        while True:
            msg, _ = await ends.inbox.get(Control)
            if msg.kind is ControlKind.READY:
                return
