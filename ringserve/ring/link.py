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
from ringserve.ring.announce import Announcements, Expectation
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


TENSOR_TAG_OFFSET = 1 << 20


def tensor_tag(tag: int) -> int:
    """The gloo tag of announced tensors on the link whose frames use `tag`."""
    if not 0 <= tag < TENSOR_TAG_OFFSET:
        raise ValueError(f"a link tag is in [0, {TENSOR_TAG_OFFSET}), got {tag}")
    return tag + TENSOR_TAG_OFFSET


@dataclass(slots=True)
class _Outgoing:
    """One message for the sender thread: its parts (buffer, tag) in order,
    and every buffer they read, kept until the sends completed."""

    parts: list[tuple[torch.Tensor, int]]
    buffers: list[torch.Tensor]


@dataclass(slots=True)
class _Pending:
    """One message handed to gloo: its Work handles and the buffers they read."""

    works: list[dist.Work]
    buffers: list[torch.Tensor]


def _wait_works(works: list[dist.Work]) -> str | None:
    """Wait on every handle, a failed one included (none is dropped
    unobserved); the first failure's reason, if any."""
    reason = None
    for work in works:
        try:
            work.wait()
        except Exception as exc:  # gloo raises RuntimeError subclasses
            reason = reason or str(exc)
    return reason


def _wait_all(pending: _Pending) -> None:
    """The reader's wait on posted receives: every handle, then the failure."""
    reason = _wait_works(pending.works)
    if reason is not None:
        raise RuntimeError(reason)


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

    async def send(self, msg: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Post `msg` and its CPU `tensors` (at most `codec.MAX_TENSORS`) to the
        peer; returns once every part is handed to gloo, waiting first while
        `max_in_flight` messages are unobserved. Raises LinkError if the link
        has failed, FrameError for a message that cannot be framed or that
        breaks the contract of announced tensors (`ring/announce.py`). No
        message may follow a `Control(SHUTDOWN)` on a link."""
        if self._shut:
            raise RuntimeError(f"send on the link to rank {self.peer} after it was shut down")
        self._raise_if_failed()
        await self._acquire_slot()
        if self._shut:  # a SHUTDOWN went out while this send waited
            self._release()
            raise RuntimeError(f"send on the link to rank {self.peer} after it was shut down")
        try:
            fr, ahead = self._frame(msg, tensors)
        except BaseException:
            self._release()  # nothing was posted: hand the slot back
            raise
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
            _log_message("msg.sent", msg, nbytes, self.peer)

    def _frame(
        self, msg: Message, tensors: Sequence[torch.Tensor]
    ) -> tuple[codec.Frame, list[torch.Tensor]]:
        """The frame of `msg`, and the placeholders a final frame sends for
        every Hidden still owed announced tensors. Updates the announcements
        only once the frame is built, so a refused send changes nothing."""
        owed = self._announcements.owed_to(msg)
        announces = self._announcements.announced_by(msg)
        ahead: list[torch.Tensor] = []
        if owed is not None:
            if tensors and tuple(codec.TensorSpec.of(t) for t in tensors) != owed.specs:
                got = [codec.TensorSpec.of(t) for t in tensors]
                raise codec.FrameError(
                    f"Hidden of pass {msg.pass_id} carries {got}, announced {list(owed.specs)}"  # type: ignore[union-attr]
                )
            flags = codec.PREPOSTED if tensors else codec.PREPOSTED | codec.PLACEHOLDER
            fr = codec.frame(msg, tensors or [s.empty() for s in owed.specs], flags)
            self._announcements.pop()
        elif codec.is_final(msg) and len(self._announcements):
            fr = codec.frame(msg, tensors, codec.PREPOSTED | codec.PLACEHOLDER)
            ahead = [s.empty() for a in self._announcements.drain() for s in a.specs]
        else:
            fr = codec.frame(msg, tensors)
        if announces:
            self._announcements.add(msg, announces, None)
        return fr, ahead

    async def flush(self) -> None:
        """Wait until every posted message is observed complete; raises
        LinkError if the link failed."""
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
                reason = _wait_works(works) or reason
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
            return works, str(exc)
        return works, None

    def _complete(self, reason: str | None) -> bool:
        """Count one message observed complete (any thread); wake the loop
        only if it waits on that, or `reason` says the send failed. False
        once the loop is closed."""
        with self._lock:
            self._done += 1
            wake, self._wake_wanted = self._wake_wanted or reason is not None, False
        return not wake or _call_on_loop(self._loop, self._progress, reason)

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
        self,
        peer: int,
        tag: int,
        inbox: Inbox,
        *,
        group: dist.ProcessGroup | None = None,
        expect: Expectation | None = None,
    ) -> None:
        self.peer, self.tag, self.tensor_tag = peer, tag, tensor_tag(tag)
        # Receives posted ahead for announced tensors, oldest first; the
        # reader thread alone touches it.
        self._announcements: Announcements[_Pending] = Announcements(expect)
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
    def stopped(self) -> bool:
        """Whether the reader thread has ended (see the module docstring on exiting)."""
        return not self._thread.is_alive()

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
        """Reader thread: receive frames until the final one or a failure.
        Two head buffers take turns: one is posted while the other is read."""
        reason, failed = f"rank {self.peer} shut the link down", False
        try:
            head, spare, final = codec.empty_head(), codec.empty_head(), False
            self._posted = [self._post(head, self.tag)]
            while not final:
                msg, tensors, final = self._receive_frame(head, spare)
                head, spare = spare, head
                if not _call_on_loop(self._loop, self._inbox.put, msg, tensors):
                    return
        except Exception as exc:  # gloo errors and bad frames alike end the link
            reason, failed = str(exc), True
        _call_on_loop(self._loop, self._end, reason, failed)

    def _receive_frame(
        self, head: torch.Tensor, following: torch.Tensor
    ) -> tuple[Message, tuple[torch.Tensor, ...], bool]:
        """Finish the frame whose head receive is posted, and post the next
        head into `following`; returns the message, its tensors, finality."""
        self._posted[0].wait()
        announced = codec.unpack_header(head)
        parts = (
            [torch.empty(announced.payload_len, dtype=torch.uint8)] if announced.overflow else []
        )
        inline = () if announced.preposted else tuple(s.empty() for s in announced.tensors)
        posted = [self._post(buf, self.tag) for buf in (*parts, *inline)]
        # The next head's receive goes up before this frame's parts land,
        # so the peer's next message never waits for this thread.
        self._posted = posted + ([] if announced.final else [self._post(following, self.tag)])
        if announced.overflow:
            posted[0].wait()
            msg = codec.decode(memoryview(parts[0].numpy()))
        else:
            msg = codec.decode(codec.inline_payload(head, announced))
        if codec.is_final(msg) != announced.final:
            raise codec.FrameError(f"a {type(msg).__name__} frame has final={announced.final}")
        tensors, placeholders = self._announced_tensors(msg, announced)
        self._expect_after(msg)
        for work in posted[len(parts) :]:
            work.wait()
        self._posted = self._posted[len(posted) :]
        tensors = inline if tensors is None else tensors
        if self._trace:
            # placeholders crossed the wire too: count them as the sender does
            nbytes = codec.HEAD_BYTES + placeholders + sum(t.nbytes for t in (*parts, *tensors))
            _log_message("msg.received", msg, nbytes, self.peer)
        return msg, tensors, announced.final

    def _announced_tensors(
        self, msg: Message, announced: codec.FrameHeader
    ) -> tuple[tuple[torch.Tensor, ...] | None, int]:
        """The tensors of `msg` received ahead (after waiting for them), or
        None when it carries its own, and the bytes of placeholders received
        for it; FrameError when the two ends disagree about what is owed,
        which would otherwise desynchronise the stream."""
        owed = self._announcements.owed_to(msg)
        if announced.final:
            drained = self._announcements.drain()
            if bool(drained) != announced.preposted:
                raise codec.FrameError(
                    f"the final frame says preposted={announced.preposted} "
                    f"with {len(drained)} Hidden(s) owed announced tensors"
                )
            for entry in drained:
                _wait_all(entry.held)
            return None, sum(b.nbytes for entry in drained for b in entry.held.buffers)
        if (owed is not None) != announced.preposted:
            raise codec.FrameError(
                f"a {type(msg).__name__} frame says preposted={announced.preposted} "
                f"but this end holds {'a' if owed else 'no'} receive for it"
            )
        if owed is None:
            return None, 0
        if announced.tensors != owed.specs:
            raise codec.FrameError(
                f"Hidden of pass {owed.pass_id} announces {list(announced.tensors)}, "
                f"owed {list(owed.specs)}"
            )
        self._announcements.pop()
        _wait_all(owed.held)
        if announced.placeholder:
            return (), sum(b.nbytes for b in owed.held.buffers)
        return tuple(owed.held.buffers), 0

    def _expect_after(self, msg: Message) -> None:
        """Post receives for the tensors `msg` announces, in link order."""
        specs = self._announcements.announced_by(msg)
        if specs:
            buffers = [s.empty() for s in specs]
            works = [self._post(buf, self.tensor_tag) for buf in buffers]
            self._announcements.add(msg, specs, _Pending(works, buffers))

    def _post(self, buf: torch.Tensor, tag: int) -> dist.Work:
        return self._group.recv([buf], self.peer, tag)

    def _end(self, reason: str, failed: bool) -> None:
        event = "link.failed" if failed else "link.closed"
        level = log.warning if failed else log.info
        level(event, peer=self.peer, tag=self.tag, side="recv", reason=reason)
        self._inbox.fail(LinkError(self.peer, reason))
        self._ended.set_result(None)
