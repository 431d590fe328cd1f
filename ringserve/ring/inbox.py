"""Per-kind inbox of one rank: one FIFO queue per message type.

There is no positional stash: `await inbox.get(Hidden)` can only ever be
satisfied by a `Hidden`, and a message of another kind that arrives first
stays queued for the wait that is owed it. The two terminal kinds, `Output`
and `Void`, share one lane (`await inbox.terminal()`), so terminals are taken
in the order the last rank sent them: pass order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TypeVar

import torch

from ringserve.ring.errors import LinkError
from ringserve.ring.messages import MESSAGE_TYPES, TERMINAL_TYPES, Message, Terminal

M = TypeVar("M", bound=Message)
Received = tuple[Message, tuple[torch.Tensor, ...]]
_TERMINAL = "terminal"  # the lane of Output and Void


def _lane(kind: type) -> type | str:
    if kind in TERMINAL_TYPES:
        return _TERMINAL
    if kind not in MESSAGE_TYPES:
        raise TypeError(f"{kind!r} is not a ring message type")
    return kind


class Inbox:
    """Queues of received `(msg, tensors)`, one lane per message type (one
    for both terminal types), FIFO within a lane. Invariant: a queued message
    is handed to exactly one wait of its own lane, in arrival order; once the inbox has failed, a `get` that finds
    its queue empty raises that failure instead of waiting (messages that
    arrived before the failure are still delivered). Loop-thread only: link
    readers reach it through `loop.call_soon_threadsafe`."""

    def __init__(self) -> None:
        lanes = {_lane(t) for t in MESSAGE_TYPES}
        self._queues: dict[type | str, deque[Received]] = {lane: deque() for lane in lanes}
        self._waiters: dict[type | str, deque[asyncio.Future[Received]]] = {
            lane: deque() for lane in lanes
        }
        self._error: LinkError | None = None

    @property
    def error(self) -> LinkError | None:
        """The failure that ended this inbox's inflow, if any."""
        return self._error

    def pending(self, kind: type[Message]) -> int:
        """Messages of `kind`'s lane received and not yet taken."""
        return len(self._queues[_lane(kind)])

    def put(self, msg: Message, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        """Deliver one received message to the oldest wait for its type."""
        lane = _lane(type(msg))
        waiters = self._waiters[lane]
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result((msg, tensors))
                return
        self._queues[lane].append((msg, tensors))

    def fail(self, error: LinkError) -> None:
        """Wake every current wait with `error`; later waits on an empty queue
        raise it too. The first failure is kept."""
        if self._error is None:
            self._error = error
        for waiters in self._waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(self._error)

    async def get(self, kind: type[M]) -> tuple[M, tuple[torch.Tensor, ...]]:
        """The oldest `(msg, tensors)` of `kind`, waiting for one if none is
        queued. Raises LinkError if the inbox failed and none is queued.
        Terminals are taken with `terminal()`, never by kind."""
        if kind in TERMINAL_TYPES:
            raise TypeError("Output and Void share one lane: wait with Inbox.terminal()")
        return await self._take(_lane(kind))  # type: ignore[return-value]

    async def terminal(self) -> Terminal:
        """The oldest terminal (Output or Void), in the order they were sent."""
        msg, _ = await self._take(_TERMINAL)
        return msg  # type: ignore[return-value]

    async def _take(self, lane: type | str) -> Received:
        queue = self._queues[lane]
        if queue:
            return queue.popleft()
        if self._error is not None:
            raise self._error
        fut: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        self._waiters[lane].append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # Handed a message in the same tick as the cancellation: put it
            # back at the front so it is not lost.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                queue.appendleft(fut.result())
            elif fut in self._waiters[lane]:
                self._waiters[lane].remove(fut)
            raise
