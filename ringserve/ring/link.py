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
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ringserve.ring.messages import Control, Message

log = structlog.get_logger(__name__)


def log_message(event: str, msg: Message, nbytes: int, peer: int) -> None:
    """`msg.sent` / `msg.received`: what `ringserve replay` pairs up per link."""
    fields: dict[str, Any] = {"kind": msg.__struct_config__.tag, "bytes": nbytes, "peer": peer}
    pass_id = getattr(msg, "pass_id", None)
    if pass_id is not None:
        fields["pass_id"] = pass_id
    if isinstance(msg, Control):
        fields.update(control=str(msg.kind), seq=msg.seq)
    log.debug(event, **fields)


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
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
class Pending:
    """One message handed to gloo: its Work handles and the buffers they read."""

    works: list[dist.Work]
    buffers: list[torch.Tensor]


def wait_works(works: list[dist.Work]) -> str | None:
    """Wait on every handle, a failed one included (none is dropped
    unobserved); the first failure's reason, if any."""
    reason = None
    for work in works:
        try:
            work.wait()
        except Exception as exc:  # gloo raises RuntimeError subclasses
            reason = reason or plain_reason(exc)
    return reason


# gloo's own words around what happened: the C++ source line ahead of it,
# and advice after it (which ends with an emoji)
_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_GLOO_ADVICE = " This is typically caused by"


def plain_reason(exc: BaseException) -> str:
    """What a failed gloo call says happened, in one line: `Connection
    closed by peer [127.0.0.1]:64691.`, not its source file and advice."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _GLOO_SOURCE.sub("", text).split(_GLOO_ADVICE, 1)[0].strip()


def wait_all(pending: Pending) -> None:
    """The reader's wait on posted receives: every handle, then the failure."""
    reason = wait_works(pending.works)
    if reason is not None:
        raise RuntimeError(reason)
