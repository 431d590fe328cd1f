"""Links of the ring: one `SendLink` and one `RecvLink` per directed pair of
neighbours, each on its own gloo tag, so messages on a link are FIFO.

gloo facts behind it (torch 2.13): `Work.is_completed()` never turns true for
send/recv without `wait()`, and `get_future()` is not implemented for them, so
every wait runs in a per-link thread that reports to the event loop through
`loop.call_soon_threadsafe`; nothing here blocks the loop. An `isend` whose
handle is dropped before the peer posts its receive is lost, and wedges the
pair of ranks behind it: a `SendLink` keeps every handle and buffer until its
thread has observed completion. No gloo timeout is ever used as a poll (a
timed-out wait poisons the process group); liveness is judged in asyncio by
`ring/watchdog.py`.

Shutdown: a blocked gloo receive cannot be interrupted (not by
`destroy_process_group`, nor `ProcessGroup.abort/shutdown`: measured), so the
sender ends a link with `Control(SHUTDOWN)` (`SendLink.close`, whose frame is
marked final); the reader delivers it and stops posting receives. A reader
whose peer died has already stopped with a LinkError. A reader whose peer is
alive but never closed is a daemon thread, so the process never hangs at exit;
but if that peer exits while this interpreter is finalizing, the receive
returns into a dying interpreter and CPython aborts (SIGABRT, "terminate called
without an active exception"). So when `RecvLink.close()` returns False, end
the process with `os._exit` once logs are flushed.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from ringserve import logs
from ringserve.ring import codec
from ringserve.ring.errors import LinkError
from ringserve.ring.messages import Control, ControlKind, Message

if TYPE_CHECKING:
    from ringserve.ring.inbox import Inbox

log = structlog.get_logger(__name__)


def _log_message(event: str, msg: Message, nbytes: int, peer: int) -> None:
    """`msg.sent` / `msg.received`: what `ringserve replay` pairs up per link."""
    fields: dict[str, Any] = {"kind": msg.__struct_config__.tag, "bytes": nbytes, "peer": peer}
    pass_id = getattr(msg, "pass_id", None)
    if pass_id is not None:
        fields["pass_id"] = pass_id
    if isinstance(msg, Control):
        fields.update(control=str(msg.kind), seq=msg.seq)
    log.debug(event, **fields)


def _call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """Run `fn(*args)` on `loop` from a link thread; False once the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


@dataclass(slots=True)
class _Pending:
    """One message handed to gloo: its Work handles and the buffers they read."""

    works: list[dist.Work]
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
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.peer, self.tag, self.max_in_flight = peer, tag, max_in_flight
        self._group = group if group is not None else dist.group.WORLD
        self._inbox = inbox
        self._trace = logs.tracing()
        self._loop = asyncio.get_running_loop()
        self._in_flight = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._settled = asyncio.Event()
        self._settled.set()
        self._error: LinkError | None = None
        self._shut = False
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._observe, name=f"ring-send-{peer}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Messages posted to gloo whose completion is not yet observed."""
        return self._in_flight

    @property
    def error(self) -> LinkError | None:
        return self._error

    async def send(self, msg: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Post `msg` and its CPU `tensors` (at most `codec.MAX_TENSORS`) to the
        peer; returns once every part is handed to gloo, waiting first while
        `max_in_flight` messages are unobserved. Raises LinkError if the link
        has failed, FrameError for a message that cannot be framed. No message
        may follow a `Control(SHUTDOWN)` on a link."""
        if self._shut:
            raise RuntimeError(f"send on the link to rank {self.peer} after it was shut down")
        self._raise_if_failed()
        buffers = codec.frame(msg, tensors)
        await self._acquire_slot()
        if self._shut:  # a SHUTDOWN went out while this send waited
            self._observed(None)
            raise RuntimeError(f"send on the link to rank {self.peer} after it was shut down")
        self._shut = codec.is_final(msg)
        works: list[dist.Work] = []
        try:
            for buf in buffers:
                works.append(self._group.send([buf], self.peer, self.tag))
        except RuntimeError as exc:
            self._fail(str(exc))
        finally:
            self._retain(_Pending(works, buffers))
        self._raise_if_failed()
        if self._trace:
            _log_message("msg.sent", msg, sum(b.nbytes for b in buffers), self.peer)

    async def flush(self) -> None:
        """Wait until every posted message is observed complete; raises
        LinkError if the link failed."""
        await self._settled.wait()
        self._raise_if_failed()

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
            log.warning("link.close_timeout", peer=self.peer, in_flight=self._in_flight)
            return
        self._shut = True
        self._queue.put(None)
        self._thread.join()

    async def _shut_down(self) -> None:
        if not self._shut and self._error is None:
            await self.send(Control(kind=ControlKind.SHUTDOWN, rank=self._group.rank()))
        await self.flush()

    def _retain(self, pending: _Pending) -> None:
        # Hand the handles to the sender thread, which holds them until their
        # waits return. Dropping them here is the bug this class exists to
        # prevent: the send is aborted and the peer waits for ever.
        self._queue.put(pending)

    def _observe(self) -> None:
        """Sender thread: wait on each message's Work handles in posting order."""
        while (pending := self._queue.get()) is not None:
            reason = None
            for work in pending.works:
                try:
                    work.wait()
                except Exception as exc:  # gloo raises RuntimeError subclasses
                    reason = reason or str(exc)
            if not _call_on_loop(self._loop, self._observed, reason):
                return

    def _observed(self, reason: str | None) -> None:
        if reason is not None:
            self._fail(reason)
        if self._slot_waiters:
            self._slot_waiters.popleft().set_result(None)  # the slot passes on
            return
        self._in_flight -= 1
        if self._in_flight == 0:
            self._settled.set()

    async def _acquire_slot(self) -> None:
        if self._in_flight < self.max_in_flight and not self._slot_waiters:
            self._in_flight += 1
            self._settled.clear()
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._slot_waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._observed(None)  # a slot was handed over as we left: pass it on
            elif fut in self._slot_waiters:
                self._slot_waiters.remove(fut)
            raise

    def _fail(self, reason: str) -> None:
        if self._error is not None:
            return
        self._error = LinkError(self.peer, reason)
        log.warning("link.failed", peer=self.peer, tag=self.tag, side="send", reason=reason)
        while self._slot_waiters:
            self._slot_waiters.popleft().set_exception(self._error)
        self._settled.set()
        if self._inbox is not None:
            self._inbox.fail(self._error)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


class RecvLink:
    """The receiving end of the link from rank `peer` on gloo `tag`.

    A daemon reader thread posts the receives of one frame after another
    (header, payload, tensors), decodes each and hands `(msg, tensors)` to
    `inbox` on the event loop. Invariants: messages reach the inbox in the
    order the peer sent them; after the peer's `Control(SHUTDOWN)` (delivered
    like any message) or a failure, no receive is posted again and the inbox
    is failed with a LinkError naming the peer, so no wait on it can hang.
    Construct it on the event loop thread."""

    def __init__(
        self, peer: int, tag: int, inbox: Inbox, *, group: dist.ProcessGroup | None = None
    ) -> None:
        self.peer, self.tag = peer, tag
        self._group = group if group is not None else dist.group.WORLD
        self._inbox = inbox
        self._trace = logs.tracing()
        self._loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[None] = self._loop.create_future()
        # Receives posted and not yet observed. Kept even after the reader
        # stops: a pending receive's handle is never dropped either.
        self._posted: list[dist.Work] = []
        self._thread = threading.Thread(target=self._read, name=f"ring-recv-{peer}", daemon=True)
        self._thread.start()

    @property
    def ended(self) -> bool:
        """Whether the reader has stopped (peer shut down, or link failed)."""
        return self._ended.done()

    async def close(self, timeout_s: float = 5.0) -> bool:
        """Wait up to `timeout_s` for the reader to stop, which it does once
        the peer's SHUTDOWN has arrived; returns whether it stopped. A reader
        still blocked in a gloo receive cannot be interrupted: it is logged
        and left as a daemon thread (see the module docstring on exiting)."""
        try:
            await asyncio.wait_for(asyncio.shield(self._ended), timeout_s)
        except TimeoutError:
            log.warning("link.reader_abandoned", peer=self.peer, tag=self.tag)
            return False
        self._thread.join()
        return True

    def _read(self) -> None:
        """Reader thread: receive frames until the final one or a failure."""
        reason, failed = f"rank {self.peer} shut the link down", False
        try:
            header, final = codec.empty_header(), False
            self._posted = [self._post(header)]
            while not final:
                msg, tensors, header, final = self._receive_frame(header)
                if not _call_on_loop(self._loop, self._inbox.put, msg, tensors):
                    return
        except Exception as exc:  # gloo errors and bad frames alike end the link
            reason, failed = str(exc), True
        _call_on_loop(self._loop, self._end, reason, failed)

    def _receive_frame(
        self, header: torch.Tensor
    ) -> tuple[Message, tuple[torch.Tensor, ...], torch.Tensor, bool]:
        """Finish the frame whose header receive is posted; returns its message,
        its tensors, the next header buffer (already posted) and finality."""
        self._posted[0].wait()
        announced = codec.unpack_header(header)
        payload = torch.empty(announced.payload_len, dtype=torch.uint8)
        tensors = tuple(spec.empty() for spec in announced.tensors)
        parts = [self._post(buf) for buf in (payload, *tensors)]
        # The next header's receive goes up before this frame's parts land,
        # so the peer's next message never waits for this thread.
        following = codec.empty_header()
        self._posted = parts + ([] if announced.final else [self._post(following)])
        for work in parts:
            work.wait()
        msg = codec.decode(memoryview(payload.numpy()))
        if codec.is_final(msg) != announced.final:
            raise codec.FrameError(f"a {type(msg).__name__} frame has final={announced.final}")
        self._posted = self._posted[len(parts) :]
        if self._trace:
            nbytes = header.nbytes + announced.payload_len + sum(t.nbytes for t in tensors)
            _log_message("msg.received", msg, nbytes, self.peer)
        return msg, tensors, following, announced.final

    def _post(self, buf: torch.Tensor) -> dist.Work:
        return self._group.recv([buf], self.peer, self.tag)

    def _end(self, reason: str, failed: bool) -> None:
        event = "link.failed" if failed else "link.closed"
        level = log.warning if failed else log.info
        level(event, peer=self.peer, tag=self.tag, side="recv", reason=reason)
        self._inbox.fail(LinkError(self.peer, reason))
        self._ended.set_result(None)
