"""The sending end of a ring link (see `ring/link.py` for the gloo facts
behind both ends)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch
import torch.distributed as dist

from ringserve import logs
from ringserve.ring import codec
from ringserve.ring.announce import Announcements, Expectation
from ringserve.ring.errors import LinkError
from ringserve.ring.link import call_on_loop, log_message, plain_reason, tensor_tag, wait_works
from ringserve.ring.messages import Control, ControlKind, Hidden, Message

if TYPE_CHECKING:
    from ringserve.ring.inbox import Inbox

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Outgoing:
    """One message for the sender thread: its parts (buffer, tag) in order,
    and every buffer they read, kept until the sends completed."""

    parts: list[tuple[torch.Tensor, int]]
    buffers: list[torch.Tensor]


class SendLink:
    """The sending end of the link to rank `peer` on gloo `tag`.

    Invariants: every Work handle `send` posts, and every buffer it reads, is
    referenced by this link until the sender thread has observed it complete
    (or fail); at most `max_in_flight` messages are posted and not yet observed
    complete; once the link has failed every `send` and every waiter raises
    the same `LinkError`, which is also handed to `inbox.fail` when an inbox
    is given, so waits for replies that can no longer come wake up. Construct
    and use it on the event loop thread."""

    def __init__(
        self,
        peer: int,
        tag: int,
        max_in_flight: int = 4,
        *,
        group: dist.ProcessGroup | None = None,
        inbox: Inbox | None = None,
        expect: Expectation | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.peer, self.tag, self.max_in_flight = peer, tag, max_in_flight
        self.tensor_tag = tensor_tag(tag)
        self._announcements: Announcements[None] = Announcements(expect)
        self._group = group if group is not None else dist.group.WORLD
        self._inbox = inbox
        self._trace = logs.tracing()
        self._loop = asyncio.get_running_loop()
        # The sender thread counts completions itself and calls the loop
        # only when a send or flush waits on one (or a send failed), so a
        # message costs the sending loop no wake-up of its own.
        self._lock = threading.Lock()  # guards the two counts and _wake_wanted
        self._posted = 0  # messages handed to gloo; the loop thread counts them
        self._done = 0  # of those, observed complete; the sender thread counts them
        self._wake_wanted = False
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._settle_waiters: list[asyncio.Future[None]] = []
        self._error: LinkError | None = None
        self._shut = False
        self._held: list[Message] = []  # to ride ahead in the next frame (see send)
        self.sent_bytes = 0  # frames handed to gloo, for /metrics
        self._queue: queue.SimpleQueue[_Outgoing | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._observe, name=f"ring-send-{peer}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Messages posted to gloo whose completion is not yet observed."""
        return self._posted - self._done

    @property
    def error(self) -> LinkError | None:
        return self._error

    @property
    def stopped(self) -> bool:
        """Whether the sender thread has ended. One still blocked in gloo at
        exit can abort the process: end it with `os._exit` instead."""
        return not self._thread.is_alive()

    async def send(
        self, msg: Message, tensors: Sequence[torch.Tensor] = (), *, hold: bool = False
    ) -> None:
        """Post `msg` and its CPU `tensors` (at most `codec.MAX_TENSORS`) to the
        peer; returns once every part is handed to gloo, waiting first while
        `max_in_flight` messages are unobserved. Raises LinkError if the link
        has failed, FrameError for a message that cannot be framed or that
        breaks the contract of announced tensors (`ring/announce.py`). No
        message may follow a `Control(SHUTDOWN)` on a link.

        `hold=True` keeps a tensorless message that is not a Hidden on this
        end instead, at once and without a slot: it travels in the frame of
        the next message posted, ahead of it, or with `flush` or `close`. A gloo message
        costs both ranks thread wake-ups that a short pass cannot pay, so a
        sender that knows another message follows soon (rank 0's Decision,
        while an earlier pass's Hidden is still to go) holds it; the caller
        owns the promise that one does."""
        if self._shut:
            raise RuntimeError(f"send on the link to rank {self.peer} after it was shut down")
        self._raise_if_failed()
        if hold:
            self._hold(msg, tensors)
            return
        await self._enqueue(msg, tensors)

    async def _enqueue(self, msg: Message | None, tensors: Sequence[torch.Tensor] = ()) -> None:
        """`send`'s posting, the held messages riding ahead of `msg`; with
        `msg` None, the newest held message is the frame's own (nothing is
        posted if none is held by the time a slot is free)."""
        await self._acquire_slot()
        if self._shut:  # a SHUTDOWN went out while this send waited
            self._release()
            raise RuntimeError(f"send on the link to rank {self.peer} after it was shut down")
        fresh = msg is not None  # a held message made its announcement then
        if msg is None:
            if not self._held:
                self._release()
                return
            msg = self._held.pop()
        try:
            fr, ahead = self._frame(msg, tensors, fresh=fresh)
        except BaseException:
            if not fresh:
                self._held.append(msg)
            self._release()  # nothing was posted: hand the slot back
            raise
        riding, self._held = self._held, []
        self._shut = codec.is_final(msg)
        tag = self.tensor_tag if fr.flags & codec.PREPOSTED else self.tag
        parts = [(fr.head, self.tag)]
        if fr.payload is not None:
            parts.append((fr.payload, self.tag))
        parts += [(t, tag) for t in (*fr.tensors, *ahead)]
        # The sender thread posts the parts, in order, and waits on them: a
        # gloo send can block its caller while it writes, and the loop must
        # not wait for that.
        self._queue.put(_Outgoing(parts, [*fr.buffers, *ahead]))
        self._raise_if_failed()
        nbytes = sum(b.nbytes for b, _ in parts)
        self.sent_bytes += nbytes
        if self._trace:
            for early in riding:  # the frame's bytes are its own message's
                log_message("msg.sent", early, 0, self.peer)
            log_message("msg.sent", msg, nbytes, self.peer)

    def _hold(self, msg: Message, tensors: Sequence[torch.Tensor]) -> None:
        if tensors or isinstance(msg, Hidden) or codec.is_final(msg):
            raise ValueError(
                f"a held message carries no tensors and is neither a Hidden nor the link's "
                f"last; got a {type(msg).__name__} with {len(tensors)} tensors"
            )
        announces = self._announcements.announced_by(msg)
        if announces:  # in call order: a later send's frame may fill them
            self._announcements.add(msg, announces, None)
        self._held.append(msg)

    @property
    def held(self) -> int:
        """Messages held to ride with the next one (see `send`)."""
        return len(self._held)

    async def _send_held(self) -> None:
        """Post the held messages in a frame of their own."""
        if self._held:
            await self._enqueue(None)

    def _frame(
        self, msg: Message, tensors: Sequence[torch.Tensor], *, fresh: bool = True
    ) -> tuple[codec.Frame, list[torch.Tensor]]:
        """The frame of `msg` with the held messages ahead of it, and the
        placeholders a final frame sends for every Hidden still owed
        announced tensors. Updates the announcements only once the frame is
        built, so a refused send changes nothing."""
        owed = self._announcements.owed_to(msg)
        announces = self._announcements.announced_by(msg) if fresh else ()
        riding = self._held
        ahead: list[torch.Tensor] = []
        if owed is not None:
            if tensors and tuple(codec.TensorSpec.of(t) for t in tensors) != owed.specs:
                got = [codec.TensorSpec.of(t) for t in tensors]
                raise codec.FrameError(
                    f"Hidden of pass {msg.pass_id} carries {got}, announced {list(owed.specs)}"  # type: ignore[union-attr]
                )
            flags = codec.PREPOSTED if tensors else codec.PREPOSTED | codec.PLACEHOLDER
            fr = codec.frame(msg, tensors or [s.empty() for s in owed.specs], flags, riding)
            self._announcements.pop()
        elif codec.is_final(msg) and len(self._announcements):
            fr = codec.frame(msg, tensors, codec.PREPOSTED | codec.PLACEHOLDER, riding)
            ahead = [s.empty() for a in self._announcements.drain() for s in a.specs]
        else:
            fr = codec.frame(msg, tensors, 0, riding)
        if announces:
            self._announcements.add(msg, announces, None)
        return fr, ahead

    async def flush(self) -> None:
        """Wait until every posted message is observed complete; raises
        LinkError if the link failed. Held messages are posted first."""
        self._raise_if_failed()
        await self._send_held()
        while True:
            self._raise_if_failed()
            with self._lock:
                if self._posted == self._done:
                    return
                self._wake_wanted = True
            fut: asyncio.Future[None] = self._loop.create_future()
            self._settle_waiters.append(fut)
            await fut

    async def close(self, timeout_s: float = 10.0) -> None:
        """End the link: send `Control(SHUTDOWN)` unless one was sent or the
        link failed, wait up to `timeout_s` for every send to complete, stop
        the sender thread. Never raises for a failed link (the failure was
        already reported); a sender still waiting at the deadline is logged
        and left as a daemon thread."""
        try:
            await asyncio.wait_for(self._shut_down(), timeout_s)
        except LinkError:
            pass
        except TimeoutError:
            log.warning("link.close_timeout", peer=self.peer, in_flight=self.in_flight)
            return
        self._shut = True
        self._queue.put(None)
        self._thread.join()

    async def _shut_down(self) -> None:
        if not self._shut and self._error is None:
            await self.send(Control(kind=ControlKind.SHUTDOWN, rank=self._group.rank()))
        await self.flush()

    def _observe(self) -> None:
        """Sender thread: post each message's parts in order, then wait on
        their Work handles, holding handles and buffers until the waits
        return (dropping them aborts the send and the peer waits for ever).
        Messages queued meanwhile are posted before the first wait, so
        several can be on the wire at once."""
        while (first := self._queue.get()) is not None:
            batch, last = [first], False
            while not self._queue.empty() and not last:
                nxt = self._queue.get_nowait()
                last = nxt is None
                if nxt is not None:
                    batch.append(nxt)
            posted = [self._post(out) for out in batch]
            for works, reason in posted:
                reason = wait_works(works) or reason
                if not self._complete(reason):
                    return
            if last:
                return

    def _post(self, out: _Outgoing) -> tuple[list[dist.Work], str | None]:
        works: list[dist.Work] = []
        try:
            for buf, tag in out.parts:
                works.append(self._group.send([buf], self.peer, tag))
        except RuntimeError as exc:
            return works, plain_reason(exc)
        return works, None

    def _complete(self, reason: str | None) -> bool:
        """Count one message observed complete (any thread); wake the loop
        only if it waits on that, or `reason` says the send failed. False
        once the loop is closed."""
        with self._lock:
            self._done += 1
            wake, self._wake_wanted = self._wake_wanted or reason is not None, False
        return not wake or call_on_loop(self._loop, self._progress, reason)

    def _progress(self, reason: str | None) -> None:
        """Loop thread: hand freed slots to waiting sends, in order, and
        wake flushes once nothing is in flight."""
        if reason is not None:
            self._fail(reason)
        with self._lock:
            while self._slot_waiters and self._posted - self._done < self.max_in_flight:
                fut = self._slot_waiters.popleft()
                if not fut.done():
                    self._posted += 1
                    fut.set_result(None)
            settled = self._posted == self._done
            self._wake_wanted = bool(self._slot_waiters or (self._settle_waiters and not settled))
        if settled:
            waiters, self._settle_waiters = self._settle_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def _release(self) -> None:
        """Give back a slot taken by a send that posted nothing."""
        with self._lock:
            self._posted -= 1
        self._progress(None)

    async def _acquire_slot(self) -> None:
        with self._lock:
            if not self._slot_waiters and self._posted - self._done < self.max_in_flight:
                self._posted += 1
                return
            self._wake_wanted = True
        fut: asyncio.Future[None] = self._loop.create_future()
        self._slot_waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release()  # a slot was handed over as we left: pass it on
            elif fut in self._slot_waiters:
                self._slot_waiters.remove(fut)
            raise

    def _fail(self, reason: str) -> None:
        if self._error is not None:
            return
        self._error = LinkError(self.peer, reason)
        log.warning("link.failed", peer=self.peer, tag=self.tag, side="send", reason=reason)
        waiters, self._settle_waiters = [*self._slot_waiters, *self._settle_waiters], []
        self._slot_waiters.clear()
        for fut in waiters:
            if not fut.done():
                fut.set_exception(self._error)
        if self._inbox is not None:
            self._inbox.fail(self._error)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
