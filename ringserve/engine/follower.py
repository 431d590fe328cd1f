"""The loop of every rank after rank 0 (DESIGN §3): replay decisions, run
layers, pass exactly one Hidden per pass on, and, on the last rank, answer
rank 0 with exactly one terminal per pass. A follower never decides."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, ThreadPoolExecutor

import msgspec
import structlog
import torch

from ringserve.engine.replica import ReplicaMismatch, Row
from ringserve.engine.stage import PassFailed, Stage
from ringserve.ring.errors import LinkError, RingFailed
from ringserve.ring.inbox import Inbox
from ringserve.ring.messages import (
    Control,
    ControlKind,
    Decision,
    Hidden,
    Output,
    RankStats,
    Void,
)
from ringserve.ring.send_link import SendLink
from ringserve.ring.watchdog import Liveness, Owed, watched

log = structlog.get_logger(__name__)


class Follower:
    """Invariant: for every Decision received, exactly one message goes on:
    a Hidden (tensor or void marker) to the successor, or, on the last rank,
    an Output or Void to rank 0 (unless a `drop` fault says otherwise)."""

    def __init__(
        self,
        stage: Stage,
        inbox: Inbox,
        send: SendLink,
        *,
        last: bool,
        wedge_timeout_s: float = 30.0,
        executor: Executor | None = None,
    ) -> None:
        self.stage = stage
        self.rank = stage.rank
        self.inbox = inbox
        self.send = send
        self.last = last
        self.wedge_timeout_s = wedge_timeout_s
        self.executor = executor if executor is not None else ThreadPoolExecutor(1, "forward")
        self.health = Liveness(rank=self.rank)
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        """Until rank 0's SHUTDOWN comes round, or a link fails (raises
        LinkError, or RingFailed once the failure went on towards rank 0)."""
        passes = asyncio.create_task(self._passes())
        controls = asyncio.create_task(self._controls())
        try:
            await asyncio.wait({passes, controls}, return_when=asyncio.FIRST_COMPLETED)
            ring_failed = passes.done() and isinstance(passes.exception(), RingFailed)
            if passes.done() and not controls.done() and not ring_failed:
                # The link ends right after SHUTDOWN; let the control loop
                # take it before judging the end a failure.
                await asyncio.wait({controls}, timeout=1.0)
            if controls.done():
                controls.result()
                return
            passes.result()
        except LinkError as exc:
            await self._upstream_gone(exc)
            raise
        finally:
            passes.cancel()
            controls.cancel()

    async def _upstream_gone(self, exc: LinkError) -> None:
        """The rank before this one is gone: rank 0, which talks to it not,
        would otherwise learn of it only as the exit of a neighbour of its
        own, and name that one. Say which, on towards rank 0 (raises
        RingFailed once said); nothing to say when that rank is rank 0, or
        the link that failed is this rank's own to its successor."""
        if exc.peer != self.rank - 1 or exc.peer == 0:
            return
        reason = f"rank {exc.peer} is gone: {exc.reason}"
        self.health.mark_dead(reason)
        await self._pass_failure_on(Control(ControlKind.FAILED, rank=exc.peer, reason=reason))
        raise RingFailed(exc.peer, reason) from exc

    async def _controls(self) -> None:
        while True:
            msg, _ = await self.inbox.get(Control)
            if msg.kind is ControlKind.SHUTDOWN:
                log.info("ring.shutdown", rank=self.rank)
                await self.send.close()
                return
            if msg.kind is ControlKind.FAILED:  # an upstream rank's: on to rank 0
                self.health.mark_dead(msg.reason)
                await self._pass_failure_on(msg)
                raise RingFailed(msg.rank, msg.reason)
            if msg.kind is ControlKind.HEARTBEAT:
                msg = msgspec.structs.replace(msg, stats=[*msg.stats, self.stats()])
            await self.send.send(msg)

    async def _pass_failure_on(self, msg: Control, timeout_s: float = 5.0) -> None:
        """Send a FAILED control on towards rank 0 and wait until it left;
        a link that fails meanwhile leaves rank 0 its own end to report."""
        try:
            await asyncio.wait_for(self._send_and_flush(msg), timeout_s)
        except (LinkError, TimeoutError):
            log.warning("ring.failure_not_passed_on", rank=self.rank, reason=msg.reason)

    async def _send_and_flush(self, msg: Control) -> None:
        await self.send.send(msg)
        await self.send.flush()

    def stats(self) -> RankStats:
        """This rank's running totals, carried to rank 0 by heartbeats."""
        stage = self.stage
        return RankStats(self.rank, stage.forwards, stage.forward_s, self.send.sent_bytes)

    async def _passes(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            decision, _ = await self.inbox.get(Decision)
            await self._run_pass(loop, decision)

    async def _run_pass(self, loop: asyncio.AbstractEventLoop, decision: Decision) -> None:
        p = decision.pass_id
        rows, void = self._apply(decision)
        if not self.last:
            # on to the next rank in the frame of this pass's Hidden (see
            # Conductor._launch): exactly one goes on whatever happens here
            await self.send.send(decision, hold=True)
        upstream = Owed(p, Hidden, self.rank - 1)
        hidden, tensors = await watched(
            self.inbox.get(Hidden), upstream, self.wedge_timeout_s, self.health
        )
        if hidden.pass_id != p:
            # links are FIFO, so the hidden of pass p was lost upstream: the
            # ring cannot go on; say so round to rank 0, which ends it
            reason = (
                f"rank {self.rank} got hidden of pass {hidden.pass_id}, owed {p}: "
                f"the hidden of pass {p} was lost"
            )
            log.error(
                "pass.lost",
                rank=self.rank,
                pass_id=p,
                kind="hidden",
                peer=self.rank - 1,
                got=hidden.pass_id,
            )
            self.health.mark_dead(reason)
            await self._pass_failure_on(Control(ControlKind.FAILED, rank=self.rank, reason=reason))
            raise RingFailed(self.rank, reason)
        void_rank = self.rank
        if hidden.void is not None:
            void, void_rank = hidden.void, hidden.void_rank
        result = None
        masks = tuple(tensors[1:])  # rank 0's grammar masks ride beside the hidden states
        if void is None:
            result, void = await self._compute(loop, decision, rows, tensors[0], masks)
        await self._pass_on(p, result, void, void_rank, masks)

    def _apply(self, decision: Decision) -> tuple[list[Row], str | None]:
        try:
            return self.stage.apply(decision), None
        except ReplicaMismatch as exc:
            log.error("replica.mismatch", rank=self.rank, pass_id=decision.pass_id, error=str(exc))
            return [], f"replica mismatch: {exc}"

    async def _compute(
        self,
        loop: asyncio.AbstractEventLoop,
        decision: Decision,
        rows: list[Row],
        x: torch.Tensor,
        masks: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor | Output | None, str | None]:
        got = masks[0] if masks else None
        try:
            compute = self.stage.compute
            return await loop.run_in_executor(self.executor, compute, decision, rows, x, got), None
        except PassFailed as exc:
            return None, str(exc)

    async def _pass_on(
        self,
        p: int,
        result: torch.Tensor | Output | None,
        void: str | None,
        void_rank: int,
        masks: tuple[torch.Tensor, ...] = (),
    ) -> None:
        if void is not None:
            log.warning("pass.void", rank=self.rank, pass_id=p, void_rank=void_rank, reason=void)
        if self.last:
            assert void is not None or isinstance(result, Output)
            await self.send.send(result if void is None else Void(p, void_rank, void))
        elif void is not None:
            await self.send.send(Hidden(p, void=void, void_rank=void_rank))
        else:
            await self.send.send(Hidden(p), [result, *masks])
