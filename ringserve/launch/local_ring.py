"""The ranks of the offline API on this machine: rank 0's conductor on an
event loop in a thread of the calling process (so `LLM.generate` stays
synchronous for the user) and, for a ring of N > 1, ranks 1..N-1 as child
processes. A ring of one runs the same conductor with no links."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import time
from collections.abc import Callable

import structlog
import torch.distributed
import uvloop

from ringserve.config import EngineConfig
from ringserve.engine.conductor import Conductor
from ringserve.engine.desk import QueueFull
from ringserve.engine.handle import RequestHandle
from ringserve.launch.boot import hidden_announcement
from ringserve.launch.processes import RankProcesses, free_port
from ringserve.launch.serve import build_conductor
from ringserve.models.config import ModelConfig
from ringserve.params import RequestOutput, SamplingParams
from ringserve.ring.faults import FaultPlan
from ringserve.ring.group import close_group, init_group
from ringserve.ring.topology import RankSpec, announce_ready, open_links

log = structlog.get_logger(__name__)


class LocalRing:
    """Invariant: while open, every child rank is alive or the conductor has
    failed with the reason; `close()` leaves no process behind."""

    def __init__(
        self,
        config: EngineConfig,
        pp_size: int,
        *,
        log_dir: str | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        if config.layer_split is None:
            raise ValueError("a local ring needs its layer split (plan/sizing.size_ring)")
        if pp_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError(
                "this process already runs a ring of several ranks (torch.distributed's one "
                "process group): close that LLM first"
            )
        self.config = config
        port = free_port()
        self.specs = [RankSpec(r, pp_size, "127.0.0.1", port) for r in range(pp_size)]
        self.children = RankProcesses(self.specs[1:], self.config, log_dir)
        atexit.register(self.close)
        self.loop = uvloop.new_event_loop()  # the loop every rank runs
        self._ready: concurrent.futures.Future[Conductor] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="rank0", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.conductor = self._await_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _await_ready(self, timeout_s: float) -> Conductor:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self._ready.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                culprit = self.children.culprit()
                if culprit is not None:
                    raise RuntimeError(f"the ring did not start: {culprit}") from None
        raise RuntimeError(f"the ring did not start within {timeout_s} s")

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to the caller waiting for readiness
            if not self._ready.done():
                self._ready.set_exception(exc)
            log.error("rank0.stopped", error=repr(exc))
        finally:
            left = asyncio.all_tasks(self.loop)  # requests of a generate cut short
            for task in left:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def _main(self) -> None:
        spec, config = self.specs[0], self.config
        self._stop = asyncio.Event()
        ends = None
        if spec.world > 1:
            init_group(0, spec.world, spec.master_addr, spec.master_port, terms=config.ring_terms())
            expect = hidden_announcement(config, ModelConfig.from_dir(config.model_dir))
            ends = open_links(spec, FaultPlan.from_env(0), expect)
        conductor = build_conductor(config, spec.world, ends)
        if ends is not None:
            await announce_ready(ends, timeout_s=300.0)
        self._ready.set_result(conductor)
        running = asyncio.create_task(conductor.run())
        watching = asyncio.create_task(self._watch_children(conductor))
        stopping = asyncio.create_task(self._stop.wait())
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        running.cancel()
        if ends is not None:
            await ends.send.close(timeout_s=5.0)  # sends SHUTDOWN round the ring
            if conductor.failure is None:
                await ends.recv.close(timeout_s=5.0)
        conductor.executor.shutdown(wait=True)
        conductor.mask_executor.shutdown(wait=True)

    async def _watch_children(self, conductor: Conductor) -> None:
        while True:
            await asyncio.sleep(0.1)
            culprit = self.children.culprit()
            if culprit is not None:
                conductor.fail(culprit)
                return

    # ---- the caller's thread ---------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_done: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """`on_done`, when given, is called (on rank 0's loop thread) with
        each request's index among `prompts` and its output as it finishes."""
        if self._closed or not self._thread.is_alive():
            raise RuntimeError(self._stopped())
        # made here, before the loop is asked to start the work, so a Ctrl-C
        # at any point after (run_coroutine_threadsafe's own lines included)
        # cancels it: a work the caller never got a handle to ran on
        future: concurrent.futures.Future[list[RequestOutput]] = concurrent.futures.Future()
        try:
            self.loop.call_soon_threadsafe(self._start, future, prompts, params, on_done)
            while True:  # a wait the caller's Ctrl-C can interrupt, and a close end
                try:
                    return future.result(timeout=0.5)
                except concurrent.futures.TimeoutError:
                    if not self._thread.is_alive():
                        raise RuntimeError(self._stopped()) from None
        except concurrent.futures.CancelledError:  # its loop closed under it
            raise RuntimeError(self._stopped()) from None
        except BaseException:  # KeyboardInterrupt too: the requests are aborted
            future.cancel()
            raise

    def _start(
        self,
        future: concurrent.futures.Future[list[RequestOutput]],
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_done: Callable[[int, RequestOutput], None] | None,
    ) -> None:
        """Loop thread: run `_generate` for `future`, unless the caller has
        already cancelled it; a later cancel cancels the work. The future
        stays pending while the work runs, so the caller can cancel it."""
        if future.cancelled():
            return
        task = self.loop.create_task(self._generate(prompts, params, on_done))

        def settle(done: asyncio.Task[list[RequestOutput]]) -> None:
            try:
                if done.cancelled():
                    future.cancel()
                elif done.exception() is not None:
                    future.set_exception(done.exception())
                else:
                    future.set_result(done.result())
            except concurrent.futures.InvalidStateError:  # the caller cancelled it first
                pass

        def cancel(f: concurrent.futures.Future[list[RequestOutput]]) -> None:
            if f.cancelled() and not self.loop.is_closed():
                self.loop.call_soon_threadsafe(task.cancel)

        task.add_done_callback(settle)
        future.add_done_callback(cancel)

    def _stopped(self) -> str:
        if self._closed:
            return "this LLM is closed"
        return f"the ring has stopped: {self.conductor.failure or 'its loop ended'}"

    async def _generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_done: Callable[[int, RequestOutput], None] | None,
    ) -> list[RequestOutput]:
        """Submit every prompt, waiting for a request to finish whenever the
        queue is at its bound (the offline caller is not refused)."""
        handles: list[RequestHandle] = []
        results: list[asyncio.Task[RequestOutput]] = []
        await self.conductor.prepare(params)
        try:
            for p, sp in zip(prompts, params, strict=True):
                while True:
                    try:
                        handle = self.conductor.submit(p, sp, stream_text=False)
                        break
                    except QueueFull:
                        pending = [r for r in results if not r.done()]
                        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                handles.append(handle)
                results.append(asyncio.ensure_future(handle.result()))
                if on_done is not None:
                    results[-1].add_done_callback(_reporting(on_done, len(results) - 1))
            return list(await asyncio.gather(*results))
        except BaseException:
            for h in handles:
                self.conductor.abort(h.req_id)
            for r in results:
                r.cancel()
            raise

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self.close)
        # A Ctrl-C landing in any step still ends the ranks and the process
        # group: a later ring in this process needs the group gone.
        try:
            if self._stop is not None and self.loop.is_running():
                self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=15.0)
        finally:
            try:
                self.children.stop()
            finally:
                if len(self.specs) > 1:
                    close_group()


def _reporting(
    on_done: Callable[[int, RequestOutput], None], index: int
) -> Callable[[asyncio.Task], None]:
    """A done-callback handing request `index`'s output, if it has one, to `on_done`."""

    def report(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            on_done(index, task.result())

    return report
