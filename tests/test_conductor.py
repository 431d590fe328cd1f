"""Rank 0's conductor applies terminals in pass order even though Outputs
and Voids wait in separate inbox queues (real scheduler, real inbox)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.radix import RadixCache
from ringserve.config import EngineConfig
from ringserve.engine.conductor import Conductor
from ringserve.params import SamplingParams
from ringserve.ring.inbox import Inbox
from ringserve.ring.messages import Output, Void
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


async def test_a_later_output_waits_for_an_earlier_void():
    sched, (first, second) = two_passes_in_flight()
    inbox = Inbox()
    conductor = Conductor(
        sched,
        None,
        None,
        RequestFactory(frozenset()),
        ring=RingEnds(inbox, None, None, last_rank=2),
    )
    order: list[int] = []
    on_output, on_void = sched.on_output, sched.on_void
    sched.on_output = lambda m: order.append(m.pass_id) or on_output(m)
    sched.on_void = lambda m: order.append(m.pass_id) or on_void(m)
    # arriving together, the later pass's Output must not be applied first
    inbox.put(Output(second.pass_id, [7] * sum(e.sample for e in second.entries)))
    inbox.put(Void(first.pass_id, 1, "injected"))
    task = asyncio.create_task(conductor._terminals())
    for _ in range(50):
        await asyncio.sleep(0.01)
        if not sched.in_flight:
            break
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert order == [first.pass_id, second.pass_id]
    assert sched.voids == 1 and not sched.in_flight
