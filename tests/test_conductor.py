"""Rank 0's conductor applies terminals in the order the last rank sent them,
which is pass order, and refuses any other (real scheduler, real inbox)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.radix import RadixCache
from ringserve.config import EngineConfig
from ringserve.engine.conductor import Conductor
from ringserve.engine.desk import RequestDesk
from ringserve.params import SamplingParams
from ringserve.ring.errors import RingFailed
from ringserve.ring.inbox import Inbox
from ringserve.ring.messages import Control, ControlKind, Output, Void
from ringserve.ring.topology import RingEnds
from ringserve.sched.request import RequestFactory
from ringserve.sched.scheduler import Scheduler, SchedulerConfig


def two_passes_in_flight() -> tuple[Scheduler, list]:
    alloc = SlotAllocator(128)
    sched = Scheduler(
        SchedulerConfig.from_engine(EngineConfig(Path("unused")), 256, passes_in_flight=2),
        alloc,
        RadixCache(alloc),
    )
    factory = RequestFactory(frozenset())
    for i in range(4):
        sched.add(factory([1, 2, 3 + i], SamplingParams(max_tokens=3, temperature=0)))
    return sched, [sched.schedule(), sched.schedule()]


def conductor_of(sched: Scheduler, inbox: Inbox) -> Conductor:
    ends = RingEnds(inbox, None, None, last_rank=2)
    desk = RequestDesk(sched, None, RequestFactory(frozenset()), vocab_size=97)
    return Conductor(sched, None, desk, ring=ends)


async def run_terminals(conductor: Conductor) -> BaseException | None:
    """Run the terminal loop until nothing is in flight or it fails."""
    task = asyncio.create_task(conductor._terminals())
    for _ in range(50):
        await asyncio.sleep(0.01)
        if task.done() or not conductor.scheduler.in_flight:
            break
    task.cancel()
    (outcome,) = await asyncio.gather(task, return_exceptions=True)
    return None if isinstance(outcome, asyncio.CancelledError) else outcome


async def test_a_void_and_an_output_are_applied_in_pass_order():
    sched, (first, second) = two_passes_in_flight()
    inbox = Inbox()
    order: list[tuple[str, int]] = []
    on_output, on_void = sched.on_output, sched.on_void
    sched.on_output = lambda m: order.append(("output", m.pass_id)) or on_output(m)
    sched.on_void = lambda m: order.append(("void", m.pass_id)) or on_void(m)
    inbox.put(Void(first.pass_id, 1, "injected"))
    inbox.put(Output(second.pass_id, [7] * sum(e.sample for e in second.entries)))
    assert await run_terminals(conductor_of(sched, inbox)) is None
    assert order == [("void", first.pass_id), ("output", second.pass_id)]
    assert sched.voids == 1 and not sched.in_flight


async def test_a_terminal_out_of_pass_order_breaks_the_ring():
    sched, (first, second) = two_passes_in_flight()
    inbox = Inbox()
    inbox.put(Output(second.pass_id, [7] * sum(e.sample for e in second.entries)))
    failure = await run_terminals(conductor_of(sched, inbox))
    assert isinstance(failure, RingFailed)
    owed = f"terminal of pass {second.pass_id} from rank 2, owed {first.pass_id}"
    assert owed in str(failure) and f"the terminal of pass {first.pass_id} was lost" in str(failure)
    assert first.pass_id in sched.in_flight and second.pass_id in sched.in_flight


async def test_a_failed_control_fails_the_ring_with_its_reason_while_passes_run():
    """Rank 0 reads every Control as it comes, not only a heartbeat's
    return between passes: a rank's FAILED ends the ring with its reason,
    and every live request fails with it."""
    sched, _ = two_passes_in_flight()
    inbox = Inbox()
    conductor = conductor_of(sched, inbox)
    reason = "rank 1 got hidden of pass 1, owed 0: the hidden of pass 0 was lost"
    inbox.put(Control(ControlKind.FAILED, rank=1, reason=reason))
    await asyncio.wait_for(conductor.run(), 5)  # the terminal of pass 0 never comes
    assert conductor.failure == reason and not conductor.health.healthy
