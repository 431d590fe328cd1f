"""Errors of the ring transport."""

from __future__ import annotations


class LinkError(Exception):
    """The link with rank `peer` is unusable: the peer died, closed the link,
    or the stream on it is out of step. `reason` says which."""

    def __init__(self, peer: int, reason: str) -> None:
        super().__init__(f"link with rank {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason


class RingFailed(Exception):
    """The ring cannot go on: rank `rank` found its stream out of step (a
    message was lost). `reason` names the rank and what it found; the
    finder sends it round to rank 0 as a `Control(FAILED)`, so the
    requests fail with it rather than with the links' ends it causes."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(reason)
        self.rank = rank
        self.reason = reason
