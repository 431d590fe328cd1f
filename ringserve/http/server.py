"""Serving the HTTP API on rank 0's loop beside the conductor."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import structlog
from aiohttp import web

from ringserve.engine.conductor import Conductor
from ringserve.http.options import HttpOptions, http_url
from ringserve.http.submission import SHUTTING_DOWN

log = structlog.get_logger(__name__)

SHUTDOWN_S = 5.0  # longest wait for handlers once the server stops
DRAIN_S = 2.0  # longest wait for the passes in flight at a signal (the launcher allows 6 s in all)


async def serve(
    conductor: Conductor, app: web.Application, options: HttpOptions, ready: Path | None = None
) -> str:
    """Serve until SIGINT/SIGTERM or until the ring fails; returns why it ended.

    On the way out the conductor launches no more passes and lets those in
    flight end (at most `DRAIN_S`), so every pass has its terminal; then no
    request still live can finish: each ends now with the reason (a stream
    gets its error event), and the server waits at most `SHUTDOWN_S` for
    their handlers to write it."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = asyncio.create_task(conductor.run())
    stopping = asyncio.create_task(stop.wait())
    url = http_url(options.host, options.port)
    log.info("server.ready", url=url)
    if ready is not None:
        ready.write_text(url)
    await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if conductor.failure is None and not running.done():
        await conductor.drain(DRAIN_S)
    reason = conductor.failure or "stopped by signal"
    running.cancel()
    stopping.cancel()
    if conductor.failure is None:  # a failed ring has ended its requests already
        conductor.desk.fail_all(SHUTTING_DOWN)
    await runner.cleanup()
    return reason
