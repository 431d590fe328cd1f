"""The replicated request table every rank keeps (DESIGN §1).

A replica never decides: it applies rank 0's decisions in pass order. Replaying
the same decisions on a fresh replica reproduces the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.engine.slot_row import SlotRow
from ringserve.ring.messages import Decision, SamplingSpec


class ReplicaMismatch(RuntimeError):
    """A decision does not fit this rank's table: the pass must be voided."""


@dataclass(slots=True)
class Row:
    """Invariant: `slots` are the KV slots of the request's context in order;
    `tokens`, kept when the sampling needs them, are that context's tokens."""

    sampling: SamplingSpec
    slots: SlotRow = field(default_factory=SlotRow)
    tokens: list[int] | None = None


class Replica:
    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}
        self.last_pass = -1

    def apply(self, decision: Decision) -> list[Row]:
        """Apply one decision; returns the rows of its entries, in order.
        Checks everything before changing anything, so a mismatch leaves the
        table as it was."""
        if decision.pass_id <= self.last_pass:
            raise ReplicaMismatch(f"pass {decision.pass_id} arrived after {self.last_pass}")
        new = {nr.req_id: nr for nr in decision.new_requests}
        for e in decision.entries:
            if e.req_id in new:
                if e.reuse is None or len(e.reuse) != e.start:
                    raise ReplicaMismatch(f"request {e.req_id} enters without its prefix")
                continue
            row = self.rows.get(e.req_id)
            if row is None or e.req_id in decision.dropped:
                raise ReplicaMismatch(f"request {e.req_id} is not in this rank's table")
            if e.start > len(row.slots) and e.reuse is None:
                raise ReplicaMismatch(
                    f"request {e.req_id} extends from {e.start} but holds {len(row.slots)} slots"
                )
        for req_id in decision.dropped:
            self.rows.pop(req_id, None)
        for req_id, nr in new.items():
            history = None if nr.history is None else list(nr.history)
            self.rows[req_id] = Row(nr.sampling, tokens=history)
        rows = []
        for e in decision.entries:
            row = self.rows[e.req_id]
            if e.reuse is not None:
                row.slots = SlotRow(e.reuse)
            else:
                row.slots.cut(e.start)
            row.slots.extend(e.slots)
            if row.tokens is not None:
                del row.tokens[e.start :]
                row.tokens.extend(e.tokens)
            rows.append(row)
        self.last_pass = decision.pass_id
        return rows
