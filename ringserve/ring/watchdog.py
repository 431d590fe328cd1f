"""Watching every await for an owed message (DESIGN §2, §9.7).

A wait that outlives the wedge timeout is a SUSPICION, not a cancellation:
`watched` logs one `wedge.suspect` event naming the pass, the kind and the
peer, turns `Liveness` red with that reason, and keeps waiting; when the message
finally arrives the suspicion is cleared. Health is liveness of the work: it
is red while any owed message is overdue or once the rank is dead.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from ringserve.ring.errors import LinkError
from ringserve.ring.messages import Message

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Owed:
    """A message this rank is owed: `kind` of pass `pass_id` from rank `peer`."""

    pass_id: int
    kind: type[Message]
    peer: int

    @property
    def kind_name(self) -> str:
        return str(self.kind.__struct_config__.tag)

    def describe(self, rank: int) -> str:
        return f"rank {rank} waits {self.kind_name} of pass {self.pass_id} from rank {self.peer}"


class Liveness:
    """Liveness of one rank's work. Invariant: `healthy` is true exactly when
    the rank is not dead and no owed wait is under suspicion; `reason` names
    the death, else the oldest open suspicion, else is None. Death is final."""

    def __init__(self, rank: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank = rank
        self._clock = clock
        self._suspicions: dict[int, str] = {}
        self._tokens = itertools.count()
        self._dead: str | None = None
        self.last_progress = clock()
        self.suspicions = 0  # ever opened, for /metrics

    @property
    def healthy(self) -> bool:
        return self._dead is None and not self._suspicions

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def reason(self) -> str | None:
        if self._dead is not None:
            return self._dead
        return next(iter(self._suspicions.values()), None)

    def mark_progress(self) -> None:
        """Record that owed work arrived (a message, a finished pass)."""
        self.last_progress = self._clock()

    def suspect(self, reason: str) -> int:
        """Open a suspicion; returns the token that `clear` closes it with."""
        token = next(self._tokens)
        self._suspicions[token] = reason
        self.suspicions += 1
        return token

    def clear(self, token: int) -> None:
        self._suspicions.pop(token, None)

    def mark_dead(self, reason: str) -> None:
        """The rank cannot make progress any more (a link failed); the first
        reason is kept."""
        if self._dead is None:
            self._dead = reason


async def watched(aw: Awaitable[T], what: Owed, timeout_s: float, health: Liveness) -> T:
    """Await `aw`, which must produce the message `what` describes.

    Past `timeout_s` logs `wedge.suspect` once, marks `health` unhealthy with
    "wedged: <what>", and keeps waiting; the suspicion is cleared when the
    wait ends. On success marks progress; on LinkError marks `health` dead
    with the error and re-raises. Cancelling `watched` cancels `aw`.

    The watch is one timer on the loop, not a task: it sits on every pass."""
    overdue = _Overdue(what, timeout_s, health)
    timer = asyncio.get_running_loop().call_later(timeout_s, overdue.fire)
    outcome = "cancelled"
    try:
        result = await aw
        outcome = "arrived"
    except LinkError as exc:
        outcome = "failed"
        health.mark_dead(str(exc))
        raise
    except asyncio.CancelledError:
        raise
    except BaseException:
        outcome = "failed"
        raise
    finally:
        timer.cancel()
        overdue.settle(outcome)
    health.mark_progress()
    return result


class _Overdue:
    """The suspicion a watched wait raises once it outlives its timeout."""

    def __init__(self, what: Owed, timeout_s: float, health: Liveness) -> None:
        self.what, self.timeout_s, self.health = what, timeout_s, health
        self.token: int | None = None
        self.started = time.monotonic()

    def _fields(self) -> dict[str, object]:
        w = self.what
        return dict(rank=self.health.rank, pass_id=w.pass_id, kind=w.kind_name, peer=w.peer)

    def fire(self) -> None:
        log.warning("wedge.suspect", waited_s=self.timeout_s, **self._fields())
        self.token = self.health.suspect(f"wedged: {self.what.describe(self.health.rank)}")

    def settle(self, outcome: str) -> None:
        if self.token is None:
            return
        self.health.clear(self.token)
        waited_s = round(time.monotonic() - self.started, 3)
        log.info("wedge.cleared", waited_s=waited_s, outcome=outcome, **self._fields())
