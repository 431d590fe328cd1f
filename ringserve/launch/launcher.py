"""`ringserve launch`: start this node's ranks, wait for the ring, print the
URL, supervise. Any rank's exit ends the whole group (a failure, exit 1,
but on a node without rank 0 whose ranks ended with rank 0's orderly
shutdown: exit 0); SIGINT/SIGTERM shut it down cleanly. No rank process
outlives the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from ringserve.config import EngineConfig, layer_range
from ringserve.http.options import HttpOptions
from ringserve.launch.processes import (
    EXIT_LINK_FAILED,
    child_command,
    child_env,
    describe_exit,
    stop_processes,
)
from ringserve.logs import say
from ringserve.ring.topology import RankSpec


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Which ranks of a `world`-rank ring this node runs."""

    world: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.world % self.nnodes:
            raise ValueError(f"--pp {self.world} is not a multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")

    @property
    def ranks(self) -> range:
        per = self.world // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)


# How long rank 0 has to shut the ring down after a stop request before the
# launcher stops every rank itself (SIGTERM: each flushes its log and ends;
# SIGKILL after `processes.stop_processes`' grace).
RING_SHUTDOWN_S = 6.0
STOP_GRACE_S = 6.0  # how long ranks asked to stop may take before SIGTERM


# On a node without rank 0: how often node 0's ring exchange is asked
# whether it still answers, and how long its silence may last before this
# node's ranks are ended (rank 0's orderly shutdown ends them sooner).
NODE0_CHECK_S = 1.0
NODE0_GONE_S = 3.0


class Launcher:
    """Invariant: `procs` holds every rank process this node started; after
    `stop()` each has exited. `node0` (a node without rank 0): whether node
    0's launcher still runs."""

    def __init__(
        self,
        node: NodeSpec,
        config: EngineConfig,
        http: HttpOptions,
        log_dir: str | None,
        node0: Callable[[], bool] | None = None,
    ) -> None:
        self.node, self.config, self.http, self.log_dir = node, config, http, log_dir
        self.node0 = node0
        self._node0_checked = time.monotonic()
        self._node0_silent_since: float | None = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.ready_file = Path(tempfile.mkdtemp(prefix="ringserve-")) / "ready"
        self.stopping = False
        self.stop_deadline = float("inf")

    def start(self) -> None:
        config = self.config
        if config.torch_threads is None:  # share this node's cores between its ranks
            threads = max(1, (os.cpu_count() or 1) // len(self.node.ranks))
            config = replace(config, torch_threads=threads)
        for rank in self.node.ranks:
            spec = RankSpec(rank, self.node.world, self.node.master_addr, self.node.master_port)
            cmd = child_command(spec, config)
            if self.log_dir:
                cmd += ["--log-dir", self.log_dir]
            if rank == 0:
                cmd += ["--http", msgspec.json.encode(self.http).decode()]
                cmd += ["--ready-file", str(self.ready_file)]
            layers = layer_range(list(self.config.layer_split or ()), rank)
            self.procs[rank] = proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=child_env()
            )
            say(f"started rank {rank} (layers {layers.start}-{layers.stop - 1}, pid {proc.pid})")

    def supervise(self) -> int:
        """Wait for readiness and then for the first rank to exit; returns
        the launcher's exit code."""
        announced = 0 not in self.procs
        while True:
            if not announced and self.ready_file.exists():
                say(f"ready at {self.ready_file.read_text()}")
                announced = True
            exited = {r: p.poll() for r, p in self.procs.items() if p.poll() is not None}
            if exited:
                return self._end(exited)
            if self._node0_gone():
                say(
                    f"node 0 is gone (its ring exchange has not answered for {NODE0_GONE_S:.0f} s); "
                    "ending this node's ranks"
                )
                self.stop(grace_s=0.0)
                return 0
            if time.monotonic() > self.stop_deadline:  # a wedged rank 0 may never get there
                say(
                    f"the ring did not shut down within {RING_SHUTDOWN_S:.0f} s; stopping every rank"
                )
                self.stop(grace_s=0.0)
                return 0
            time.sleep(0.1)

    def _node0_gone(self) -> bool:
        """Whether node 0's exchange has been silent for NODE0_GONE_S (asked
        every NODE0_CHECK_S); never on node 0."""
        now = time.monotonic()
        if self.node0 is None or now - self._node0_checked < NODE0_CHECK_S:
            return False
        self._node0_checked = now
        if self.node0():
            self._node0_silent_since = None
            return False
        if self._node0_silent_since is None:
            self._node0_silent_since = now
        return now - self._node0_silent_since >= NODE0_GONE_S

    def _end(self, exited: dict[int, int | None]) -> int:
        time.sleep(0.3)  # let a cascade of link failures show its first cause
        exited = {r: p.poll() for r, p in self.procs.items() if p.poll() is not None}
        if self.stopping:
            self.stop()
            return 0
        if 0 not in self.procs and all(code == 0 for code in exited.values()):
            # rank 0's orderly SHUTDOWN went round: node 0 was stopped
            say("rank 0 shut the ring down; this node's ranks have ended")
            self.stop()
            return 0
        cause = next(((r, c) for r, c in exited.items() if c not in (0, EXIT_LINK_FAILED)), None)
        rank, code = cause if cause is not None else next(iter(exited.items()))
        why = describe_exit(code)
        if code == EXIT_LINK_FAILED:  # every rank here ended with the ring
            why = "its ring failed: a link to a neighbour ended, or a message was lost; its ring.failed line says which"
        if code == EXIT_LINK_FAILED and self.node.nnodes > 1:  # no rank here says otherwise
            why += ", likely on another node: its launcher says why"
        say(f"rank {rank} exited ({why}); ending the group")
        self.stop()
        return 1

    def request_stop(self, *_: object) -> None:
        if not self.stopping:
            self.stop_deadline = time.monotonic() + RING_SHUTDOWN_S
        self.stopping = True
        if 0 not in self.procs:
            # this node's ranks end with rank 0's SHUTDOWN, if node 0 stops too
            say(
                "stopping: this node's ranks end once rank 0 shuts the ring down, "
                f"or in {STOP_GRACE_S:.0f} s"
            )
            self.stop()
        elif self.procs[0].poll() is not None:
            self.stop()
        elif self.ready_file.exists():
            self.procs[0].send_signal(signal.SIGTERM)  # rank 0 shuts the ring down
        else:  # no ring yet (ranks still connecting or loading): each rank stops now
            self.stop(grace_s=0.0)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        stop_processes(list(self.procs.values()), grace_s)


def launch(
    node: NodeSpec,
    config: EngineConfig,
    http: HttpOptions,
    log_dir: str | None,
    node0: Callable[[], bool] | None = None,
) -> int:
    """Run this node's ranks until they end; `node0` on the other nodes:
    whether node 0's launcher still runs (see `Launcher`)."""
    launcher = Launcher(node, config, http, log_dir, node0)
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    try:
        launcher.start()
        return launcher.supervise()
    finally:
        launcher.stop(grace_s=0.5 if not launcher.stopping else STOP_GRACE_S)
