"""Rank processes: the command line that starts one, and their supervision
from the parent (no process outlives the one that started it)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import structlog

from ringserve import logs
from ringserve.config import EngineConfig
from ringserve.ring.topology import RankSpec, RingEnds

log = structlog.get_logger(__name__)

# A rank that exits because a link to it failed is a casualty, not a culprit.
EXIT_LINK_FAILED = 3
EXIT_REFUSED = 4  # a rank whose ring settings differ from rank 0's (ring/group.py)


def encode_config(config: EngineConfig) -> str:
    return msgspec.json.encode(config, enc_hook=str).decode()


def decode_config(text: str) -> EngineConfig:
    return msgspec.json.decode(text, type=EngineConfig, dec_hook=_as_path)


def _as_path(kind: type, value: object) -> object:
    if kind is Path:
        return Path(str(value))
    raise NotImplementedError(kind)


def die_with_parent() -> None:
    """Ask Linux to end this process when its parent dies (no orphans).
    Ranks run in their own session, so a terminal's Ctrl-C reaches only the
    launcher, which shuts the ring down in order."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_command(spec: RankSpec, config: EngineConfig) -> list[str]:
    """The command line of one rank process (it carries `--rank R`)."""
    return [
        sys.executable, "-m", "ringserve.launch.rank",
        "--rank", str(spec.rank), "--world", str(spec.world),
        "--master-addr", spec.master_addr, "--master-port", str(spec.master_port),
        "--config", encode_config(config),
    ]  # fmt: skip


def child_env() -> dict[str, str]:
    """A rank process's environment: this one's, with torch's C++ warnings
    off unless asked for (`TORCH_CPP_LOG_LEVEL`): a rendezvous retry cut
    short by a stop prints a whole C++ stack, which says nothing a rank's
    own lines do not."""
    return {**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankProcesses:
    """Child rank processes. Invariant: after `stop()` none is running."""

    def __init__(self, specs: list[RankSpec], config: EngineConfig, log_dir: str | None) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        for spec in specs:
            cmd = child_command(spec, config) + (["--log-dir", log_dir] if log_dir else [])
            self.procs[spec.rank] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=child_env()
            )

    def culprit(self) -> str | None:
        """A rank that exited on its own (not because a link to it failed)."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None and code not in (0, EXIT_LINK_FAILED):
                return f"rank {rank} exited ({describe_exit(code)})"
        return None

    def stop(self, grace_s: float = 5.0) -> None:
        stop_processes(list(self.procs.values()), grace_s)


def describe_exit(code: int | None) -> str:
    """A rank process's end in words."""
    # a rank is sent SIGKILL here only after it was asked to stop; the
    # kernel's out-of-memory killer sends it unasked
    if code == -signal.SIGKILL:
        return "killed by SIGKILL: by the kernel for lack of memory, or by hand"
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Give processes `grace_s` to exit, then SIGTERM, then SIGKILL; returns
    only once every one has exited."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exit_now_if_stuck(ends: RingEnds, code: int) -> None:
    """End a rank process at once, logs flushed, when one of its link
    threads is still blocked in gloo: at a normal exit that thread would
    return into a dying interpreter, which aborts (SIGABRT). Only for rank
    processes, never the caller's process of an offline LLM."""
    if ends.send.stopped and ends.recv.stopped:
        return
    log.warning("rank.exit_now", code=code, reason="a link thread is still blocked in gloo")
    logs.flush()
    os._exit(code)
