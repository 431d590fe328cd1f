"""Per-kind inbox of one rank: one FIFO queue per message type.

There is no positional stash: `await inbox.get(Hidden)` can only ever be
satisfied by a `Hidden`, and a message of another kind that arrives first
stays queued for the wait that is owed it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TypeVar

import torch

from ringserve.ring.errors import LinkError
from ringserve.ring.messages import MESSAGE_TYPES, Message

M = TypeVar("M", bound=Message)
Received = tuple[Message, tuple[torch.Tensor, ...]]


class Inbox:
    """Queues of received `(msg, tensors)`, one per message type, FIFO within
    a type. Invariant: a queued message is handed to exactly one `get` of its
    own type, in arrival order; once the inbox has failed, a `get` that finds
    its queue empty raises that failure instead of waiting (messages that
    arrived before the failure are still delivered). Loop-thread only: link
    readers reach it through `loop.call_soon_threadsafe`."""

    def __init__(self) -> None:
        self._queues: dict[type, deque[Received]] = {t: deque() for t in MESSAGE_TYPES}
        self._waiters: dict[type, deque[asyncio.Future[Received]]] = {
            t: deque() for t in MESSAGE_TYPES
        }
        self._error: LinkError | None = None

    @property
    def error(self) -> LinkError | None:
        """The failure that ended this inbox's inflow, if any."""
        return self._error

    def pending(self, kind: type[Message]) -> int:
        """Messages of `kind` received and not yet taken."""
        return len(self._queues[self._known(kind)])

    def put(self, msg: Message, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        """Deliver one received message to the oldest wait for its type."""
        kind = type(msg)
        waiters = self._waiters[self._known(kind)]
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result((msg, tensors))
                return
        self._queues[kind].append((msg, tensors))

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
        queued. Raises LinkError if the inbox failed and none is queued."""
        queue = self._queues[self._known(kind)]
        if queue:
            return queue.popleft()  # type: ignore[return-value]
        if self._error is not None:
            raise self._error
        fut: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        self._waiters[kind].append(fut)
        try:
            return await fut  # type: ignore[return-value]
        except asyncio.CancelledError:
            # Handed a message in the same tick as the cancellation: put it
            # back at the front so it is not lost.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                queue.appendleft(fut.result())
            elif fut in self._waiters[kind]:
                self._waiters[kind].remove(fut)
            raise

    @staticmethod
    def _known(kind: type) -> type:
        if kind not in MESSAGE_TYPES:
            raise TypeError(f"{kind!r} is not a ring message type")
        return kind
