"""Logging of a rank: structlog events as JSON lines in `LOGDIR/rank{R}.jsonl`
(every event, for `ringserve replay`) and a readable rendering on stderr
(events at or above the console level).

Lines reach the file within `FLUSH_EVERY_S` of their event (a flush
thread), at `flush()`, and when the log is closed or the process exits
normally; a rank process also flushes on SIGTERM/SIGINT (`launch/rank.py`),
so only a SIGKILL loses anything, and then at most its last 50 ms.

Events below both levels are dropped by structlog's level gate before any
processor runs. Code that would compute something costly only for a debug
event (a digest, a large field) asks `tracing()` once, when the object that
logs is built, and skips the work when it is False.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import msgspec
import structlog

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "exception": 40, "critical": 50}
NO_FILE = 100
# Every event reaches the file within this long: a rank killed by SIGKILL
# loses at most its last FLUSH_EVERY_S of events.
FLUSH_EVERY_S = 0.05


class _Sink:
    """A JSON log file fed whole lines, written out at least every
    `FLUSH_EVERY_S` by its own thread and on `flush()`. Invariant: lines
    reach the file whole and in the order they were added, and nothing is
    written after `close()`."""

    def __init__(self, path: Path) -> None:
        self.out: IO[bytes] | None = path.open("ab", buffering=0)
        self.pending: list[bytes] = []
        # Reentrant: a signal handler that flushes may run on a thread that
        # holds them (`launch/rank.py`), and must not deadlock it.
        self.lock = threading.RLock()  # guards `pending`; held only to swap or append
        self.writing = threading.RLock()  # one batch written at a time, in order
        self.closed = threading.Event()
        threading.Thread(target=self._flush_often, name="log-flush", daemon=True).start()

    def add(self, line: bytes) -> None:
        if self.out is None:  # closed, or ended by a write it refused
            return
        with self.lock:
            self.pending.append(line)

    def flush(self) -> None:
        """Write what was added. A file that refuses a write (a full disk)
        ends the log there, said once on stderr; the rank goes on."""
        with self.writing:
            with self.lock:
                batch, self.pending = self.pending, []
            data = memoryview(b"".join(batch))
            try:
                while data and self.out is not None:  # an unbuffered write may be partial
                    data = data[self.out.write(data) :]
            except OSError as exc:
                out, self.out = self.out, None
                self.closed.set()
                if out is not None:
                    with contextlib.suppress(OSError):
                        out.close()
                    say(f"the log {out.name} stops here: {exc.strerror or exc}")

    def close(self) -> None:
        self.closed.set()
        self.flush()
        with self.writing:
            out, self.out = self.out, None
        if out is not None:
            with contextlib.suppress(OSError):
                out.close()

    def _flush_often(self) -> None:
        while not self.closed.wait(FLUSH_EVERY_S):
            if self.pending:
                self.flush()


class _Console:
    """structlog's logger behind the processors: hands what the last
    processor rendered to a writer thread, and nothing for an event that only
    the file keeps (cheaper than raising DropEvent for every debug event).

    A rank must never stop because nobody reads its stderr (a full pipe, a
    paused pager): the thread that logged never writes to stderr itself.
    Invariant: lines come out whole and in order; beyond `BACKLOG` unwritten
    lines a new one is dropped and counted, and the count is printed once
    stderr takes lines again. The JSON file keeps every event regardless."""

    BACKLOG = 2000

    def __init__(self) -> None:
        self.lines: deque[str] = deque()
        self.dropped = 0
        self.ready = threading.Condition()
        self.idle = threading.Event()
        self.idle.set()
        self.closing = False
        self.thread: threading.Thread | None = None

    def msg(self, message: str) -> None:
        if not message:
            return
        with self.ready:
            if len(self.lines) >= self.BACKLOG:
                self.dropped += 1
                return
            self.lines.append(message)
            self.idle.clear()
            if self.thread is None:
                self.thread = threading.Thread(target=self._write, name="log-console", daemon=True)
                self.thread.start()
            self.ready.notify()

    debug = info = warning = warn = error = err = critical = fatal = exception = failure = msg
    log = msg

    def flush(self, timeout_s: float = 1.0) -> None:
        """Wait up to `timeout_s` for the lines handed over so far to be written."""
        self.idle.wait(timeout_s)

    def close(self) -> None:
        """Write what is pending (for at most a second), then end the thread:
        a console replaced by a new configuration leaves no thread behind."""
        self.flush()
        with self.ready:
            self.closing = True
            self.ready.notify()

    def _write(self) -> None:
        while True:
            with self.ready:
                while not self.lines:
                    self.idle.set()
                    if self.closing:
                        self.thread = None  # a later line starts a new writer
                        return
                    self.ready.wait()
                batch, dropped = list(self.lines), self.dropped
                self.lines.clear()
                self.dropped = 0
            text = "\n".join(batch) + "\n"
            if dropped:
                text += f"ringserve: {dropped} console lines dropped: stderr was not being read\n"
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed: the file still has every event
                pass


class _Tee:
    """Writes each event at or above `level` as one JSON line, stamped with
    the rank and a monotonic timestamp, and renders those at or above
    `console_level` for the console. Invariant: once closed it writes
    nothing; lines never interleave (the loop, the forward executor and the
    link threads all log); every line reaches the file within
    `FLUSH_EVERY_S`, and at `flush()`."""

    def __init__(
        self, rank: int, sink: _Sink | None, level: int, console_level: int, console: _Console
    ) -> None:
        self.rank = rank
        self.console = console
        self.sink = sink
        self.level = level
        self.console_level = console_level
        self.encoder = msgspec.json.Encoder(enc_hook=str)
        # plain tracebacks: a rich one renders every frame's locals (a request's
        # body among them), which took the event loop minutes on a deep one
        self.render = structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
        if sink is not None:  # flushed and closed when dropped, or at exit
            weakref.finalize(self, sink.close)

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> str:
        level = LEVELS.get(method, 20)
        event.setdefault("rank", self.rank)
        if event.get("exc_info"):  # the traceback as text, for the file and the console alike
            event = structlog.processors.format_exc_info(logger, method, event)
        sink = self.sink
        if sink is not None and level >= self.level:
            event["t"] = time.monotonic()
            event["level"] = method
            sink.add(self.encoder.encode(event) + b"\n")
            del event["t"], event["level"]
        if level < self.console_level:
            return ""
        return self.render(logger, method, event)

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()
        self.console.flush()

    def close(self) -> None:
        self.console.flush()
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.close()


def _install(
    rank: int,
    log_dir: str | Path | None,
    console_level: str,
    file_level: str,
    final: bool = False,
) -> _Tee:
    sink, file_floor = None, NO_FILE
    if log_dir is not None:
        path = Path(log_dir) / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        sink, file_floor = _Sink(path), LEVELS[file_level]
    console = _Console()
    tee = _Tee(rank, sink, file_floor, LEVELS[console_level], console)
    weakref.finalize(tee, console.close)  # its lines written when replaced, or at exit
    structlog.configure(
        processors=[tee],
        wrapper_class=structlog.make_filtering_bound_logger(min(LEVELS[console_level], file_floor)),
        logger_factory=lambda *_: console,  # one logger, not one built per call
        # A module logger assembles itself on every call unless cached; a
        # cached one keeps the configuration it first saw, so only a
        # process configured once and for good may cache.
        cache_logger_on_first_use=final,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if sink is not None:
        # Each opening starts a run: replay reads a file from its last marker.
        structlog.get_logger(__name__).debug("log.opened", pid=os.getpid())
    return tee


def configure(
    rank: int = 0,
    log_dir: str | Path | None = None,
    console_level: str = "info",
    file_level: str = "debug",
    *,
    final: bool = False,
) -> Path | None:
    """Configure structlog for this process; returns the JSON log's path.
    `final`: this configuration stays for the life of the process (a rank
    process), so module loggers may cache it: a debug event then costs
    about half as much. Reconfiguring later reaches only loggers not yet
    used."""
    _install(rank, log_dir, console_level, file_level, final)
    return Path(log_dir) / f"rank{rank}.jsonl" if log_dir is not None else None


def claim_log_dir(log_dir: str | Path, node: int = 0) -> IO[str]:
    """Hold `log_dir` for this node of one server while the returned file
    stays open: two servers logging into one directory would interleave
    their ranks' files, and replay would read one broken ring out of two
    sound ones. The nodes of one ring each hold their own claim, so they may
    share a directory. ValueError naming the directory when it is held."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    held = (Path(log_dir) / f".node{node}.lock").open("w")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        held.close()
        raise ValueError(
            f"log dir {log_dir} is in use by another server (node {node} of its ring logs "
            "there): give each server its own log directory"
        ) from None
    return held


def say(text: str) -> None:
    """One `ringserve: ...` line on stderr, written in one call so that the
    console thread's lines never land inside it (print writes the text and
    its newline apart)."""
    try:
        sys.stderr.write(f"ringserve: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed
        pass


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
