"""What every rank does with a decision: apply it to the replica, run the
rank's layers, and (on the last rank) sample. Rank 0 uses the same stage for
its own layers, so there is one definition of a pass's execution."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
import torch

from ringserve import logs
from ringserve.engine.replica import Replica, Row
from ringserve.engine.runner import Runner
from ringserve.kernels.batch import ForwardBatch
from ringserve.ring.faults import FaultPlan
from ringserve.ring.messages import Decision, Output

log = structlog.get_logger(__name__)

# A pass's packed grammar masks, one row per masked entry, beside its Hidden;
# on rank 0 alone, a callable that waits for them.
MaskSource = torch.Tensor | Callable[[], torch.Tensor] | None


class PassFailed(RuntimeError):
    """This rank cannot run the pass; the reason travels as a void."""


class Stage:
    """Invariant: decisions are applied in pass order, each exactly once."""

    def __init__(self, runner: Runner, rank: int) -> None:
        self.runner = runner
        self.rank = rank
        self.replica = Replica()
        self.forwards = 0  # passes computed here, and their seconds, for /metrics
        self.forward_s = 0.0
        self._trace = logs.tracing()  # asked once: a digest per pass is not free

    def apply(self, decision: Decision) -> list[Row]:
        rows = self.replica.apply(decision)
        if self._trace:
            digest = decision.digest()
            log.debug("decision.applied", rank=self.rank, pass_id=decision.pass_id, digest=digest)
        return rows

    def compute(
        self,
        decision: Decision,
        rows: list[Row],
        hidden: torch.Tensor | None,
        masks: MaskSource = None,
    ) -> torch.Tensor | Output:
        """Run this rank's layers; the last rank returns the pass's Output,
        sampled under the pass's grammar masks (`masks`: rank 0's, or a
        callable that waits for them). Raises PassFailed when the pass
        cannot run here."""
        began = time.monotonic()
        try:
            with self.runner.on_device():  # the forward thread's own current device
                out, batch = self._run(decision, rows, hidden, masks)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise PassFailed(f"{type(exc).__name__}: {exc}") from exc
        spent = time.monotonic() - began
        self.forwards += 1
        self.forward_s += spent
        log.debug(
            "pass.forward",
            rank=self.rank,
            pass_id=decision.pass_id,
            tokens=batch.num_tokens,
            ms=round(spent * 1e3, 3),
        )
        return out

    def _run(
        self, decision: Decision, rows: list[Row], hidden: torch.Tensor | None, masks: MaskSource
    ) -> tuple[torch.Tensor | Output, ForwardBatch]:
        self.runner.move_kv(decision)
        batch = self.runner.batch(decision, rows)
        out = self.runner.forward(decision, batch, hidden)
        if self.runner.last:
            got = masks() if callable(masks) else masks
            return self.runner.sample(decision, rows, batch, out, got), batch
        return self.runner.to_wire(out), batch


class FaultyStage(Stage):
    """A stage with its rank's injected faults (`ring/faults.py`): a crash
    when the pass is applied, a void or a delay when it is computed."""

    def __init__(self, runner: Runner, rank: int, faults: FaultPlan) -> None:
        super().__init__(runner, rank)
        self.faults = faults

    def apply(self, decision: Decision) -> list[Row]:
        self.faults.crash_now(decision.pass_id)
        return super().apply(decision)

    def compute(
        self,
        decision: Decision,
        rows: list[Row],
        hidden: torch.Tensor | None,
        masks: MaskSource = None,
    ) -> torch.Tensor | Output:
        if self.faults.should_void(decision.pass_id):
            raise PassFailed("injected void")
        failing = [e.req_id for e in decision.entries if e.req_id in self.faults.fail_requests]
        if failing:
            raise PassFailed(f"injected failure of request {failing[0]}")
        if delay := self.faults.slow_s(len(self.runner.layers)):
            time.sleep(delay)
        return super().compute(decision, rows, hidden, masks)
