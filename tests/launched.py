"""A real `ringserve launch` subprocess for end-to-end tests: started on a
free port, ready once it prints its URL, and always torn down with every
rank process it started checked gone."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTED = re.compile(r"started rank (\d+) .*pid (\d+)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class Launched:
    """Invariant: after `stop()` neither the launcher nor any rank it
    reported is alive."""

    def __init__(self, *args: str, port: int | None = None, env: dict[str, str] | None = None,
                 expect_ready: bool = True) -> None:  # fmt: skip
        self.port = port or free_port()
        cmd = [sys.executable, "-m", "ringserve", "launch", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.lines: list[str] = []
        self.ranks: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if expect_ready:
            self.wait_for("ready at", 180)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if m := STARTED.search(line):
                self.ranks[int(m.group(1))] = int(m.group(2))

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if text in line:
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"launcher never said {text!r}:\n" + "\n".join(self.lines[-30:]))

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> float:
        """Signal the launcher; returns seconds until every process was gone."""
        began = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        while (
            any(pid_alive(p) for p in self.ranks.values()) and time.monotonic() - began < timeout_s
        ):
            time.sleep(0.05)
        gone = time.monotonic() - began
        for pid in self.ranks.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"rank process {pid} outlived its launcher")
        self._reader.join(timeout=5)
        return gone

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
