"""One rank of the ring as a process: `python -m ringserve.launch.rank --rank R
--world N --master-addr A --master-port P --config JSON`.

Ranks after 0 run a `Follower`; rank 0 runs the `Conductor`, either inside
the offline `LLM` (launch/local_ring.py) or as the serving process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import msgspec
import structlog

from ringserve import logs
from ringserve.config import EngineConfig, layer_range
from ringserve.engine.follower import Follower
from ringserve.launch.boot import build_stage, hidden_announcement, report_loaded
from ringserve.launch.processes import (
    EXIT_LINK_FAILED,
    EXIT_REFUSED,
    decode_config,
    die_with_parent,
    exit_now_if_stuck,
)
from ringserve.models.config import ModelConfig
from ringserve.ring.errors import LinkError, RingFailed
from ringserve.ring.faults import FaultPlan
from ringserve.ring.group import RingMismatch, close_group, init_group
from ringserve.ring.topology import RankSpec, open_links

log = structlog.get_logger(__name__)

RING_END_WAIT_S = 10.0  # how long a rank that failed the ring waits for rank 0 to end it


def end_on_signal(rank: int) -> None:
    """On SIGTERM or SIGINT (the launcher stopping the group, or the parent
    gone), log it, flush the log, and end by that signal as the default
    action would: the launcher reads the signal from the exit status, and
    the log holds everything up to the end."""

    def end(signum: int, _frame: object) -> None:
        log.warning("rank.terminated", rank=rank, signal=signal.Signals(signum).name)
        logs.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, end)


async def run_follower(spec: RankSpec, config: EngineConfig) -> int:
    cfg = ModelConfig.from_dir(config.model_dir)
    split = list(config.layer_split or ())
    stage = build_stage(config, cfg, layer_range(split, spec.rank), spec.rank)
    report_loaded(stage)
    ends = open_links(spec, FaultPlan.from_env(spec.rank), hidden_announcement(config, cfg))
    follower = Follower(
        stage,
        ends.inbox,
        ends.send,
        last=spec.last,
        wedge_timeout_s=config.wedge_timeout_s,
    )
    try:
        await follower.run()
    except LinkError as exc:
        log.error("ring.failed", rank=spec.rank, peer=exc.peer, reason=exc.reason)
        if exc.peer == spec.rank + 1 and not spec.last:
            # The successor is gone, and the rank after it tells rank 0 so:
            # leaving now would end this rank's link from rank 0 first, and
            # rank 0 would name this rank. Wait (bounded) for rank 0 to end it.
            await ends.recv.close(timeout_s=RING_END_WAIT_S)
        # the other link's thread may still wait in gloo for a peer that is alive
        exit_now_if_stuck(ends, EXIT_LINK_FAILED)
        return EXIT_LINK_FAILED
    except RingFailed as exc:
        log.error("ring.failed", rank=spec.rank, reason=exc.reason)
        # The failure went on towards rank 0, which ends the ring: leaving
        # first would end this rank's links, and rank 0 could see that end
        # before the reason. Wait (bounded) for rank 0 to end this link.
        if await ends.recv.close(timeout_s=RING_END_WAIT_S):
            await ends.send.close(timeout_s=2.0)  # rank 0's SHUTDOWN goes on round
        exit_now_if_stuck(ends, EXIT_LINK_FAILED)
        return EXIT_LINK_FAILED
    await ends.recv.close(timeout_s=2.0)
    exit_now_if_stuck(ends, 0)
    return 0


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
    logs.configure(spec.rank, args.log_dir, console_level="warning", final=True)
    end_on_signal(spec.rank)  # rank 0's server takes both signals over while it serves
    if spec.rank == 0 and args.http is None:
        raise SystemExit("rank 0 runs inside `LLM` or `ringserve launch`, not here")
    if spec.world > 1:
        try:
            init_group(
                spec.rank, spec.world, spec.master_addr, spec.master_port, terms=config.ring_terms()
            )
        except RingMismatch as exc:
            logs.say(f"rank {spec.rank}: {exc}")
            close_group()
            return EXIT_REFUSED
    try:
        import uvloop

        if spec.rank == 0:
            from ringserve.http.options import HttpOptions
            from ringserve.launch.serve import run_rank_zero

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
