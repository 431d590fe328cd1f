"""Joining the ring's process group leaves the program's excepthook alone."""

from __future__ import annotations

import socket
import sys

from ringserve.ring.group import close_group, init_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_joining_and_leaving_groups_keeps_the_excepthook():
    hook = sys.excepthook
    for _ in range(2):  # torch would wrap the hook once per group joined
        init_group(0, 1, "127.0.0.1", _free_port(), connect_timeout_s=10)
        try:
            assert sys.excepthook is hook
        finally:
            close_group()
    assert sys.excepthook is hook
