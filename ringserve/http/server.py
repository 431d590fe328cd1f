"""Serving the HTTP API on rank 0's loop beside the conductor."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import structlog
from aiohttp import web

from ringserve.engine.conductor import Conductor
from ringserve.http.options import HttpOptions

log = structlog.get_logger(__name__)


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
