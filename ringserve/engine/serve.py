"""Rank 0 as the serving process: the conductor and the HTTP API on one
event loop. With one rank there is no ring; with more, rank 0 joins the gloo
group, opens its links and waits for READY to come round before serving."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web

from ringserve.engine.boot import EngineConfig, build_rank_zero, build_stage, layer_range
from ringserve.engine.conductor import Conductor, RingPorts
from ringserve.models.config import ModelConfig
from ringserve.ring.faults import FaultPlan

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 4 << 20


def build_conductor(config: EngineConfig, world: int = 1, ends=None) -> Conductor:
    """Rank 0's conductor: the whole model with no ring (`world` 1), or rank
    0's slice of a ring whose links are open (`engine/rank.open_links`).
    Build it on the loop that will run it."""
    cfg = ModelConfig.from_dir(config.model_dir)
    layers = range(cfg.num_layers) if world == 1 else layer_range(list(config.layer_split or ()), 0)
    stage = build_stage(config, cfg, layers, rank=0)
    zero = build_rank_zero(config, cfg, world=world)
    ring = None if ends is None else RingPorts(ends.send, ends.inbox, world - 1)
    return Conductor(
        zero.scheduler,
        stage,
        zero.tokenizer,
        zero.new_request,
        ring=ring,
        faults=FaultPlan.from_env(0),
        wedge_timeout_s=config.wedge_timeout_s,
        heartbeat_s=config.heartbeat_s,
    )


async def serve(
    conductor: Conductor, app: web.Application, options: HttpOptions, ready: Path | None = None
) -> str:
    """Serve until SIGINT/SIGTERM or until the ring fails; returns why it ended."""
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = asyncio.create_task(conductor.run())
    stopping = asyncio.create_task(stop.wait())
    url = f"http://{options.host}:{options.port}"
    log.info("server.ready", url=url)
    if ready is not None:
        ready.write_text(url)
    await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    reason = conductor.failure or "stopped by signal"
    running.cancel()
    stopping.cancel()
    await runner.cleanup()
    return reason


async def run_rank_zero(spec, config: EngineConfig, http: HttpOptions, ready_file: str | None) -> int:
    """The serving rank 0 process: build, wait for the ring, serve, and shut
    the ring down on the way out. Returns the process exit code."""
    from pathlib import Path

    from ringserve.engine.rank import EXIT_LINK_FAILED, announce_ready, open_links, report_loaded
    from ringserve.http.app import create_app

    ends = None
    if spec.world > 1:
        ends = open_links(spec)
        conductor = build_conductor(config, spec.world, ends)
        report_loaded(conductor.stage)
        await announce_ready(ends, timeout_s=600.0)
    else:
        conductor = build_conductor(config)
        report_loaded(conductor.stage)
    app = create_app(conductor, http, plan=config.plan, model_dir=config.model_dir)
    ready = Path(ready_file) if ready_file else None
    reason = await serve(conductor, app, http, ready)
    if ends is not None:
        await ends.send.close(timeout_s=5.0)
        if conductor.failure is None:
            await ends.recv.close(timeout_s=5.0)
    conductor.executor.shutdown(wait=False, cancel_futures=True)
    if conductor.failure is not None:
        log.error("server.stopped", reason=reason)
        return EXIT_LINK_FAILED
    return 0
