"""Logging of a rank: structlog events as JSON lines in `LOGDIR/rank{R}.jsonl`
(every event, for `ringserve replay`) and a readable rendering on stderr
(events at or above the console level).

Events below both levels are dropped by structlog's level gate before any
processor runs. Code that would compute something costly only for a debug
event (a digest, a large field) asks `tracing()` once, when the object that
logs is built, and skips the work when it is False.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import msgspec
import structlog

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "exception": 40, "critical": 50}
NO_FILE = 100


class _Tee:
    """Writes each event at or above `level` as one JSON line, stamped with
    the rank and a monotonic timestamp, before the console sees it.
    Invariant: once closed it writes nothing; lines never interleave (the
    loop, the forward executor and the link threads all log)."""

    def __init__(self, rank: int, out: IO[bytes] | None, level: int) -> None:
        self.rank = rank
        self.out = out
        self.level = level
        self.lock = threading.Lock()
        self.encoder = msgspec.json.Encoder(enc_hook=str)

    def __call__(self, _logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("rank", self.rank)
        event["t"] = time.monotonic()
        if self.out is not None and LEVELS.get(method, 20) >= self.level:
            line = self.encoder.encode(dict(event, level=method)) + b"\n"
            with self.lock:
                if self.out is not None:
                    self.out.write(line)
        return event

    def flush(self) -> None:
        with self.lock:
            if self.out is not None:
                self.out.flush()

    def close(self) -> None:
        with self.lock:
            out, self.out = self.out, None
        if out is not None:
            out.close()


class _ConsoleGate:
    def __init__(self, level: int) -> None:
        self.level = level

    def __call__(self, _logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        if LEVELS.get(method, 20) < self.level:
            raise structlog.DropEvent
        event.pop("t", None)
        return event


def _install(rank: int, log_dir: str | Path | None, console_level: str, file_level: str) -> _Tee:
    out, file_floor = None, NO_FILE
    if log_dir is not None:
        path = Path(log_dir) / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        out, file_floor = path.open("ab", buffering=1 << 16), LEVELS[file_level]
    tee = _Tee(rank, out, file_floor)
    structlog.configure(
        processors=[
            tee,
            _ConsoleGate(LEVELS[console_level]),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(min(LEVELS[console_level], file_floor)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if out is not None:
        # Each opening starts a run: replay reads a file from its last marker.
        structlog.get_logger(__name__).debug("log.opened", pid=os.getpid())
    return tee


def configure(
    rank: int = 0,
    log_dir: str | Path | None = None,
    console_level: str = "info",
    file_level: str = "debug",
) -> Path | None:
    """Configure structlog for this process; returns the JSON log's path."""
    _install(rank, log_dir, console_level, file_level)
    return Path(log_dir) / f"rank{rank}.jsonl" if log_dir is not None else None


def tracing() -> bool:
    """Whether debug events are kept now (a JSON log is open, or the console
    shows debug). Ask once when building an object that logs per pass."""
    probe = structlog.get_logger(__name__)
    enabled = getattr(probe, "is_enabled_for", None)
    return True if enabled is None else bool(enabled(logging.DEBUG))


def flush() -> None:
    """Flush the JSON log (at exit and before a deliberate crash)."""
    for proc in structlog.get_config()["processors"]:
        if isinstance(proc, _Tee):
            proc.flush()


@contextmanager
def silenced() -> Iterator[None]:
    """Drop every event below critical inside (a replay re-runs the scheduler,
    whose events must not land in, or be mistaken for, a run's log). Not for
    use while another thread's events matter."""
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    try:
        yield
    finally:
        structlog.configure(**previous)


class LogScope:
    """Logging configured for a stretch of a process (an offline `LLM`'s
    life, whose rank 0 runs in the caller's process). Invariant: after
    `close()` its JSON log is flushed and closed, and the structlog
    configuration found at opening is back unless another scope has since
    taken over."""

    def __init__(
        self, rank: int, log_dir: str | Path | None, console_level: str = "warning"
    ) -> None:
        self._previous: dict[str, Any] | None = structlog.get_config()
        self._tee = _install(rank, log_dir, console_level, "debug")
        self.path = Path(log_dir) / f"rank{rank}.jsonl" if log_dir is not None else None
        atexit.register(self.close)

    def close(self) -> None:
        if self._previous is None:
            return
        previous, self._previous = self._previous, None
        atexit.unregister(self.close)
        if self._tee in structlog.get_config()["processors"]:
            structlog.configure(**previous)
        self._tee.close()
