"""Logging of a rank: structlog events as JSON lines in `LOGDIR/rank{R}.jsonl`
(every event, for `ringserve replay`) and a readable rendering on stderr
(events at or above the console level)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import IO, Any

import msgspec
import structlog

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class _Tee:
    """Writes each event as one JSON line, stamped with the rank and a
    monotonic timestamp, before the console sees it."""

    def __init__(self, rank: int, out: IO[bytes] | None) -> None:
        self.rank = rank
        self.out = out
        self.encoder = msgspec.json.Encoder(enc_hook=str)

    def __call__(self, _logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("rank", self.rank)
        event["t"] = time.monotonic()
        if self.out is not None:
            record = dict(event, level=method)
            self.out.write(self.encoder.encode(record) + b"\n")
        return event


class _ConsoleGate:
    def __init__(self, level: int) -> None:
        self.level = level

    def __call__(self, _logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        if LEVELS.get(method, 20) < self.level:
            raise structlog.DropEvent
        event.pop("t", None)
        return event


def configure(
    rank: int = 0,
    log_dir: str | Path | None = None,
    console_level: str = "info",
    file_level: str = "debug",
) -> Path | None:
    """Configure structlog for this process; returns the JSON log's path."""
    out, path = None, None
    if log_dir is not None:
        path = Path(log_dir) / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        out = path.open("ab", buffering=1 << 16)
    floor = min(LEVELS[console_level], LEVELS[file_level] if out is not None else 100)
    structlog.configure(
        processors=[
            _Tee(rank, out),
            _ConsoleGate(LEVELS[console_level]),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(floor),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return path


def flush() -> None:
    """Flush the JSON log (at exit and before a deliberate crash)."""
    for proc in structlog.get_config()["processors"]:
        if isinstance(proc, _Tee) and proc.out is not None:
            proc.out.flush()
