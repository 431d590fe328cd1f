"""Errors of the ring transport."""

from __future__ import annotations


class LinkError(Exception):
    """The link with rank `peer` is unusable: the peer died, closed the link,
    or the stream on it is out of step. `reason` says which."""

    def __init__(self, peer: int, reason: str) -> None:
        super().__init__(f"link with rank {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason
