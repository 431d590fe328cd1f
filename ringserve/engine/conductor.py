"""Rank 0's loop: the only scheduler, its own stage, and the ring (DESIGN §3).

Rank 0 keeps up to S passes in flight. For each pass it applies the decision
to its own replica, sends it down the ring, runs its layers in an executor
thread (so the loop, and the HTTP server on it, stay responsive) and sends
the hidden states after it. Exactly one terminal, Output or Void, comes back
per pass from the last rank. With one rank the pass ends locally.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import structlog
import torch

from ringserve import logs
from ringserve.engine.desk import RequestDesk
from ringserve.engine.drafter import Drafter
from ringserve.engine.handle import RequestHandle
from ringserve.engine.heartbeat import Heartbeat
from ringserve.engine.metrics import Metrics, RankReports
from ringserve.engine.stage import PassFailed, Stage
from ringserve.models.tokenizer import Tokenizer
from ringserve.params import SamplingParams
from ringserve.ring.errors import LinkError, RingFailed
from ringserve.ring.messages import Decision, Hidden, Output, RankStats, Void
from ringserve.ring.topology import RingEnds
from ringserve.ring.watchdog import Liveness, Owed, watched
from ringserve.sched.scheduler import Scheduler

log = structlog.get_logger(__name__)

DRAIN_POLL_S = 0.005  # how often `drain` looks for the passes in flight to have ended


class Conductor:
    """Invariant: every pass sent is in `scheduler.in_flight` until its one
    terminal is applied; a request's handle gets every token exactly once."""

    def __init__(
        self,
        scheduler: Scheduler,
        stage: Stage,
        desk: RequestDesk,
        *,
        ring: RingEnds | None = None,
        wedge_timeout_s: float = 30.0,
        heartbeat_s: float = 1.0,
        executor: Executor | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.drafter = drafter
        self.stage = stage
        self.desk = desk
        self.ring = ring
        self.wedge_timeout_s = wedge_timeout_s
        self.heartbeat_s = heartbeat_s
        self.executor = executor if executor is not None else ThreadPoolExecutor(1, "forward")
        self.mask_executor = ThreadPoolExecutor(1, "masks")  # grammar masks, beside the forward
        self.health = Liveness(rank=0)
        self._wake = asyncio.Event()
        self._launched = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._draining = False  # set by `drain`: no pass is launched after it
        self.failure: str | None = None
        self.ranks = RankReports()  # the other ranks' totals, as heartbeats bring them
        self._trace = logs.tracing()  # asked once: digests per pass are not free
        log.info(
            "scheduler.config",
            config=scheduler.config,
            kv_capacity=scheduler.allocator.capacity,
            host_kv_capacity=scheduler.cache.host_capacity,
            eos_ids=sorted(desk.new_request.eos_ids),
            world=1 if ring is None else ring.last_rank + 1,
        )

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.desk.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.desk.vocab_size

    @property
    def metrics(self) -> Metrics:
        return self.desk.metrics

    @property
    def handles(self) -> dict[int, RequestHandle]:
        return self.desk.handles

    def rank_stats(self) -> list[tuple[RankStats, float]]:
        """(running totals, age in seconds) per rank: rank 0's read now, the
        others' as the last heartbeat brought them."""
        sent = 0 if self.ring is None else self.ring.send.sent_bytes
        own = RankStats(0, self.stage.forwards, self.stage.forward_s, sent)
        return [(own, 0.0), *self.ranks.latest()]

    def submit(
        self, prompt: list[int], params: SamplingParams, stream_text: bool = True
    ) -> RequestHandle:
        """Queue a request; raises ValueError for one that can never run.
        `stream_text=False` decodes the text once at the end (nobody reads
        the deltas' text)."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        handle = self.desk.submit(prompt, params, stream_text)
        self._wake.set()
        return handle

    async def prepare(self, params: list[SamplingParams]) -> None:
        """Compile the grammars of `params` off the event loop, so `submit`
        finds them compiled; ValueError (GrammarError) naming what is wrong."""
        grammars = self.desk.grammars
        for so in {
            p.structured_outputs.key(): p.structured_outputs for p in params if p.structured_outputs
        }.values():
            if grammars is None:
                raise ValueError("structured_outputs are not available on this engine")
            await grammars.prepare(so)

    def abort(self, req_id: int, reason: str = "abort") -> None:
        self.desk.abort(req_id, reason)
        self._wake.set()

    async def run(self) -> None:
        """Run until the ring fails or the task is cancelled."""
        jobs = [self._pump()]
        if self.ring is not None:
            beat = Heartbeat(
                self.ring,
                self.scheduler,
                self.heartbeat_s,
                self.wedge_timeout_s,
                self.health,
                self.ranks,
            )
            jobs += [self._terminals(), beat.run()]
        self._tasks = [asyncio.create_task(j) for j in jobs]
        try:
            await asyncio.gather(*self._tasks)
        except LinkError as exc:
            self.fail(f"rank {exc.peer} is gone: {exc.reason}")
        except RingFailed as exc:
            self.fail(exc.reason)
        except Exception as exc:  # a bug on rank 0 must not leave requests hanging
            self.fail(f"rank 0 failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            for t in self._tasks:
                t.cancel()

    async def drain(self, timeout_s: float) -> None:
        """Launch no more passes, and wait (at most `timeout_s`, and not past
        a failure) until those in flight have their terminals: a shutdown then
        leaves no pass half-done on any rank, and the logs replay whole.
        Requests still live stay so; the caller ends them."""
        self._draining = True
        self._wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.scheduler.in_flight and self.failure is None and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._draining:
            if self.drafter is not None:
                await self._draft(loop)
            decision = self.scheduler.schedule()
            if decision is None:
                if self._trace:  # the call may have evicted or retracted: a re-run repeats it
                    log.debug("decision.none", next_pass_id=self.scheduler.next_pass_id)
                self._wake.clear()
                if not self._draining:
                    await self._wake.wait()
                continue
            await self._launch(loop, decision)

    async def _draft(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let the draft model propose for the idle decoding requests, in the
        forward thread; each offer is an input of the scheduler (and of its
        re-run, so it is logged)."""
        spec = self.scheduler.speculation
        asks = spec.asks(self.scheduler.running)
        live = {r.req_id for r in self.scheduler.running} | {
            r.req_id for r in self.scheduler.waiting
        }
        self.drafter.release(live)
        if not asks:
            return
        drafts = await loop.run_in_executor(self.executor, self.drafter.propose, asks)
        for req_id, history, _ in asks:
            if req_id in drafts:
                spec.offer(req_id, len(history), drafts[req_id])
                if self._trace:
                    log.debug("spec.offer", req_id=req_id, at=len(history), tokens=drafts[req_id])

    async def _launch(self, loop: asyncio.AbstractEventLoop, decision: Decision) -> None:
        p = decision.pass_id
        if self._trace:
            log.debug(
                "decision.made",
                pass_id=p,
                mb_slot=decision.mb_slot,
                digest=decision.digest(),
                decision=decision,
            )
        rows = self.stage.apply(decision)
        if self.ring is not None:
            # The decision rides in the frame of the pass's own Hidden (a
            # void one if the forward fails): one gloo message fewer a pass,
            # whose thread wake-ups on both ranks cost a short pass more than
            # rank 1 gains from having it early; rank 1 replays passes in
            # order and takes this one only once it has passed the last on.
            await self.ring.send.send(decision, hold=True)
            self._launched.set()
        masks = self._masks(decision)  # filled while rank 0's forward runs
        try:
            on_rank0 = masks.result if self.ring is None and masks is not None else None
            compute = self.stage.compute
            forward = loop.run_in_executor(self.executor, compute, decision, rows, None, on_rank0)
            # rank 0's own forward is owed work too: a hung one turns health red
            result = await watched(forward, Owed(p, Output, 0), self.wedge_timeout_s, self.health)
        except PassFailed as exc:
            if self.ring is None:
                self._on_terminal(Void(p, 0, str(exc)))
            else:
                await self.ring.send.send(Hidden(p, void=str(exc), void_rank=0))
            return
        if self.ring is None:
            self._on_terminal(result)
        else:
            # the decision announced the masks of its masked entries: they ride along
            got = [] if masks is None else [await asyncio.wrap_future(masks)]
            await self.ring.send.send(Hidden(p), [result, *got])

    def _masks(self, decision: Decision) -> Future[torch.Tensor] | None:
        """The packed grammar masks of the pass's masked entries, being
        filled on the mask thread; None when no entry is masked."""
        masked = [e.req_id for e in decision.entries if e.masked]
        if not masked:
            return None
        if self.desk.grammars is None:
            raise RuntimeError("a masked entry on an engine without structured outputs")
        return self.mask_executor.submit(self.desk.grammars.masks, masked)

    async def _terminals(self) -> None:
        """Apply the one terminal owed for each pass, in pass order: the last
        rank sends them in that order on one FIFO link, so a terminal of any
        other pass than the oldest in flight means the stream is broken."""
        assert self.ring is not None
        while True:
            if not self.scheduler.in_flight:
                self._launched.clear()
                await self._launched.wait()
                continue
            oldest = next(iter(self.scheduler.in_flight))  # passes enter in pass order
            what = Owed(oldest, Output, self.ring.last_rank)
            msg = await watched(self.ring.inbox.terminal(), what, self.wedge_timeout_s, self.health)
            if msg.pass_id != oldest:
                raise RingFailed(
                    0,
                    f"rank 0 got the terminal of pass {msg.pass_id} from rank "
                    f"{self.ring.last_rank}, owed {oldest}: the terminal of pass {oldest} was lost",
                )
            self._on_terminal(msg)

    def _on_terminal(self, msg: Output | Void) -> None:
        if isinstance(msg, Output):
            record = self.scheduler.in_flight[msg.pass_id]
            # A grammar that the pass completes ends its request with `stop`
            # before the scheduler takes the tokens (which may reach
            # max_tokens: `stop` is still the reason); the log keeps that order.
            self._advance_grammars(record.decision, msg)
            if self._trace:
                log.debug(
                    "pass.output",
                    pass_id=msg.pass_id,
                    tokens=msg.tokens,
                    fallbacks=msg.fallbacks,
                    accepted=msg.accepted,
                )
            taken = self.scheduler.tokens_taken
            touched = self.scheduler.on_output(msg)
            self.metrics.passes += 1
            self.metrics.generation_tokens += self.scheduler.tokens_taken - taken
        else:
            touched = self.scheduler.on_void(msg)
        self.health.mark_progress()
        self.desk.deliver(touched)
        self._wake.set()

    def _advance_grammars(self, decision: Decision, out: Output) -> None:
        """Each constrained request's matcher takes its accepted token; a
        grammar that is complete ends its request (`stop`), one the token
        broke fails it. Both go through the scheduler's abort, which the log
        records for a re-run."""
        grammars = self.desk.grammars
        if grammars is None:
            return
        sampled = [e.req_id for e in decision.entries if e.sample]
        counts = out.accepted if out.accepted is not None else [1] * len(sampled)
        at = 0
        for req_id, n in zip(sampled, counts, strict=True):
            # a constrained request proposes nothing, so it yields one token
            for token in out.tokens[at : at + n]:
                reason = grammars.accept(req_id, token)
                if reason is not None:
                    self.scheduler.abort(req_id, reason)
                    break
            at += n

    def fail(self, reason: str) -> None:
        """The ring is broken: fail every live request with the reason."""
        if self.failure is not None:
            return
        self.failure = reason
        self.health.mark_dead(reason)
        log.error("ring.failed", rank=0, reason=reason)
        self.desk.fail_all(reason)
        for task in self._tasks:
            task.cancel()
