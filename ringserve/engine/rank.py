"""One rank of the ring as a process: `python -m ringserve.engine.rank --rank R
--world N --master-addr A --master-port P --config JSON`.

Ranks after 0 run a `Follower`; rank 0 runs the `Conductor`, either inside
the offline `LLM` (engine/local_ring.py) or as the serving process.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from ringserve import logs
from ringserve.engine.boot import EngineConfig, build_stage, layer_range
from ringserve.engine.follower import Follower
from ringserve.models.config import ModelConfig
from ringserve.ring.faults import FaultPlan
from ringserve.ring.group import close_group, init_group
from ringserve.ring.inbox import Inbox
from ringserve.ring.link import LinkError, RecvLink, SendLink
from ringserve.ring.messages import Control, ControlKind

log = structlog.get_logger(__name__)

MAX_IN_FLIGHT = 8
EXIT_LINK_FAILED = 3


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Where one rank sits in the ring."""

    rank: int
    world: int
    master_addr: str
    master_port: int

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


@dataclass(slots=True)
class RingEnds:
    inbox: Inbox
    send: SendLink
    recv: RecvLink


def open_links(spec: RankSpec) -> RingEnds:
    """This rank's two links, each on the tag of its sending rank. Call on
    the rank's event loop."""
    inbox = Inbox()
    recv = RecvLink(spec.prev, spec.prev, inbox)
    send = SendLink(spec.next, spec.rank, MAX_IN_FLIGHT, inbox=inbox)
    return RingEnds(inbox, send, recv)


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
        sys.executable, "-m", "ringserve.engine.rank",
        "--rank", str(spec.rank), "--world", str(spec.world),
        "--master-addr", spec.master_addr, "--master-port", str(spec.master_port),
        "--config", encode_config(config),
    ]  # fmt: skip


async def run_follower(spec: RankSpec, config: EngineConfig) -> int:
    cfg = ModelConfig.from_dir(config.model_dir)
    split = list(config.layer_split or ())
    stage = build_stage(config, cfg, layer_range(split, spec.rank), spec.rank)
    report_loaded(stage)
    ends = open_links(spec)
    follower = Follower(
        stage,
        ends.inbox,
        ends.send,
        last=spec.last,
        faults=FaultPlan.from_env(spec.rank),
        wedge_timeout_s=config.wedge_timeout_s,
    )
    try:
        await follower.run()
    except LinkError as exc:
        log.error("ring.failed", rank=spec.rank, peer=exc.peer, reason=exc.reason)
        return EXIT_LINK_FAILED
    await ends.recv.close(timeout_s=2.0)
    return 0


def report_loaded(stage) -> None:
    """One line per rank on stderr: the launcher's loading progress."""
    runner = stage.runner
    mib = runner.pool.nbytes / 2**20
    print(
        f"ringserve: rank {stage.rank} loaded layers {runner.layers.start}-{runner.layers.stop - 1}, "
        f"KV pool of {runner.pool.capacity} tokens ({mib:.1f} MiB)",
        file=sys.stderr,
        flush=True,
    )


async def announce_ready(ends: RingEnds, timeout_s: float) -> None:
    """Rank 0: send READY round the ring and wait for it to come back, which
    it does only once every rank has loaded its slice and opened its links."""
    await ends.send.send(Control(ControlKind.READY))
    async with asyncio.timeout(timeout_s):
        while True:
            msg, _ = await ends.inbox.get(Control)
            if msg.kind is ControlKind.READY:
                return


def parse_args(argv: list[str] | None) -> tuple[RankSpec, EngineConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="ringserve-rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--http", default=None, help="rank 0: HttpOptions as JSON")
    p.add_argument("--ready-file", default=None, help="rank 0: written once serving")
    args = p.parse_args(argv)
    spec = RankSpec(args.rank, args.world, args.master_addr, args.master_port)
    return spec, decode_config(args.config), args


def main(argv: list[str] | None = None) -> int:
    spec, config, args = parse_args(argv)
    die_with_parent()
    logs.configure(spec.rank, args.log_dir, console_level="warning")
    if spec.rank == 0 and args.http is None:
        raise SystemExit("rank 0 runs inside `LLM` or `ringserve launch`, not here")
    if spec.world > 1:
        init_group(spec.rank, spec.world, spec.master_addr, spec.master_port)
    try:
        import uvloop

        if spec.rank == 0:
            from ringserve.engine.serve import HttpOptions, run_rank_zero

            http = msgspec.json.decode(args.http, type=HttpOptions)
            code = uvloop.run(run_rank_zero(spec, config, http, args.ready_file))
        else:
            code = uvloop.run(run_follower(spec, config))
    finally:
        logs.flush()
        if spec.world > 1:
            close_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
