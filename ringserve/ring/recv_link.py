"""The receiving end of a ring link (see `ring/link.py` for the gloo facts
behind both ends, and for why a reader still blocked at exit means ending
the process with `os._exit`)."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import structlog
import torch
import torch.distributed as dist

from ringserve import logs
from ringserve.ring import codec
from ringserve.ring.announce import Announcements, Expectation
from ringserve.ring.errors import LinkError
from ringserve.ring.link import (
    Pending,
    call_on_loop,
    log_message,
    plain_reason,
    tensor_tag,
    wait_all,
)
from ringserve.ring.messages import Hidden, Message

if TYPE_CHECKING:
    from ringserve.ring.inbox import Inbox

log = structlog.get_logger(__name__)


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
        self._announcements: Announcements[Pending] = Announcements(expect)
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
            # Each head with its byte view, made once: a torch op per frame
            # costs more than the reading it serves.
            head = (t := codec.empty_head(), codec.head_view(t))
            spare, final = (t := codec.empty_head(), codec.head_view(t)), False
            self._posted = [self._post(head[0], self.tag)]
            while not final:
                received, final = self._receive_frame(head, spare)
                head, spare = spare, head
                delivered = (
                    call_on_loop(self._loop, self._inbox.put, *received[0])
                    if len(received) == 1
                    else call_on_loop(self._loop, self._deliver, received)
                )
                if not delivered:
                    return
        except Exception as exc:  # gloo errors and bad frames alike end the link
            reason, failed = plain_reason(exc), True
        call_on_loop(self._loop, self._end, reason, failed)

    def _deliver(self, received: list[tuple[Message, tuple[torch.Tensor, ...]]]) -> None:
        """Loop thread: a bundle's messages into the inbox, in order."""
        for msg, tensors in received:
            self._inbox.put(msg, tensors)

    def _receive_frame(
        self, head_buf: tuple[torch.Tensor, memoryview], following: tuple[torch.Tensor, memoryview]
    ) -> tuple[list[tuple[Message, tuple[torch.Tensor, ...]]], bool]:
        """Finish the frame whose head receive is posted into `head_buf`, and
        post the next head into `following` (each a head and its view);
        returns the frame's messages with their tensors (a bundle's early
        ones carry none), and finality."""
        self._posted[0].wait()
        view = head_buf[1]
        announced = codec.unpack_header(view)
        parts = (
            [torch.empty(announced.payload_len, dtype=torch.uint8)] if announced.overflow else []
        )
        inline = () if announced.preposted else tuple(s.empty() for s in announced.tensors)
        posted = [self._post(buf, self.tag) for buf in (*parts, *inline)]
        # The next head's receive goes up before this frame's parts land,
        # so the peer's next message never waits for this thread.
        self._posted = posted + ([] if announced.final else [self._post(following[0], self.tag)])
        if announced.overflow:
            posted[0].wait()
            payload = memoryview(parts[0].numpy())
        else:
            payload = codec.inline_payload(view, announced)
        *early, msg = codec.decode_bundle(payload) if announced.bundle else [codec.decode(payload)]
        for m in early:  # they were sent before msg: their announcements come first
            if isinstance(m, Hidden) or codec.is_final(m):
                raise codec.FrameError(f"a {type(m).__name__} rode ahead in a bundle")
            self._expect_after(m)
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
            for m in early:
                log_message("msg.received", m, 0, self.peer)
            log_message("msg.received", msg, nbytes, self.peer)
        return [*((m, ()) for m in early), (msg, tensors)], announced.final

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
                wait_all(entry.held)
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
        wait_all(owed.held)
        if announced.placeholder:
            return (), sum(b.nbytes for b in owed.held.buffers)
        return tuple(owed.held.buffers), 0

    def _expect_after(self, msg: Message) -> None:
        """Post receives for the tensors `msg` announces, in link order."""
        specs = self._announcements.announced_by(msg)
        if specs:
            buffers = [s.empty() for s in specs]
            works = [self._post(buf, self.tensor_tag) for buf in buffers]
            self._announcements.add(msg, specs, Pending(works, buffers))

    def _post(self, buf: torch.Tensor, tag: int) -> dist.Work:
        return self._group.recv([buf], self.peer, tag)

    def _end(self, reason: str, failed: bool) -> None:
        event = "link.failed" if failed else "link.closed"
        level = log.warning if failed else log.info
        level(event, peer=self.peer, tag=self.tag, side="recv", reason=reason)
        self._inbox.fail(LinkError(self.peer, reason))
        self._ended.set_result(None)
