"""Tensors announced ahead: a message may announce the tensors that the
`Hidden` of its pass will carry on the same link (a `Decision` fixes the
shape and dtype of the hidden states that follow it), so the receiver can
post their receives before the Hidden's head arrives and gloo moves them
without waiting a round trip for the receive.

Both ends of a link keep an `Announcements` FIFO, fed the same messages in
the same order by the same pure `Expectation`, so they agree on which
Hidden fills which posted receives. The contract that keeps the tensor
stream in step: once a message announced tensors, the Hidden of its pass is
the next Hidden of that pass on the link, it is sent after every Hidden
announced before it, and it carries exactly the announced tensors, or none
at all (a void Hidden; the link then sends placeholders of the announced
shapes, and the receiver delivers no tensors). What is still owed when the
link shuts down is filled with placeholders too, so no receive is left
posted. A break of the contract raises FrameError instead of desynchronising.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ringserve.ring.codec import FrameError, TensorSpec
from ringserve.ring.messages import Hidden, Message

Expectation = Callable[[Message], Sequence[TensorSpec]]
"""The tensors the Hidden of `msg`'s pass will carry on this link; empty when
`msg` announces none. Pure: it runs on both ends, the receiving one in the
link's reader thread."""

T = TypeVar("T")


@dataclass(slots=True)
class Announced(Generic[T]):
    """One Hidden owed its announced tensors; `held` is what the end keeps
    for it (the receiver: its posted receives)."""

    pass_id: int
    specs: tuple[TensorSpec, ...]
    held: T


class Announcements(Generic[T]):
    """The Hiddens this end of a link owes announced tensors, oldest first."""

    def __init__(self, expect: Expectation | None) -> None:
        self._expect = expect
        self._owed: deque[Announced[T]] = deque()

    def __len__(self) -> int:
        return len(self._owed)

    def announced_by(self, msg: Message) -> tuple[TensorSpec, ...]:
        """What `msg` announces (empty without an expectation)."""
        if self._expect is None:
            return ()
        specs = tuple(self._expect(msg))
        if specs and not isinstance(getattr(msg, "pass_id", None), int):
            raise FrameError(f"a {type(msg).__name__} without a pass id cannot announce tensors")
        return specs

    def add(self, msg: Message, specs: tuple[TensorSpec, ...], held: T) -> None:
        self._owed.append(Announced(msg.pass_id, specs, held))  # type: ignore[union-attr]

    def owed_to(self, msg: Message) -> Announced[T] | None:
        """The oldest entry if `msg` is the Hidden it is owed to, None if
        `msg` is owed nothing; FrameError for a Hidden out of its turn."""
        if not isinstance(msg, Hidden) or not self._owed:
            return None
        if self._owed[0].pass_id == msg.pass_id:
            return self._owed[0]
        if any(a.pass_id == msg.pass_id for a in self._owed):
            raise FrameError(
                f"Hidden of pass {msg.pass_id} is out of turn: the Hidden of pass "
                f"{self._owed[0].pass_id} was announced first and is still owed"
            )
        return None

    def pop(self) -> Announced[T]:
        return self._owed.popleft()

    def drain(self) -> list[Announced[T]]:
        """Every entry still owed, oldest first; the FIFO is left empty."""
        owed, self._owed = list(self._owed), deque()
        return owed
