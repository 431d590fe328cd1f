"""The wait-for chain of a run that ended with passes unfinished (wedged or
cut off), read from the last events of every rank: rank 0 waits the
terminal of its oldest unfinished pass from the last rank; a rank that has
not received the decision or the hidden states of that pass waits them from
its predecessor; the chain ends at the rank that had everything it was owed
and sent nothing on, or at a message sent and never received."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.replay.checks import TERMINAL_KINDS, Terminals
from ringserve.replay.report import Wait, Wedge
from ringserve.replay.trace import Trace

TERMINAL = "output"
_QUIET = ("msg.sent", "msg.received", "decision.applied")


@dataclass(frozen=True, slots=True)
class _Flows:
    """(kind, pass id) of what each rank sent and received."""

    sent: dict[int, set[tuple[str, int]]]
    received: dict[int, set[tuple[str, int]]]

    @classmethod
    def of(cls, trace: Trace) -> _Flows:
        def keys(rank: int, name: str) -> set[tuple[str, int]]:
            return {
                (e["kind"], e["pass_id"])
                for e in trace.events(rank, name)
                if e.get("pass_id") is not None
            }

        ranks = range(trace.world)
        return cls(
            {r: keys(r, "msg.sent") for r in ranks}, {r: keys(r, "msg.received") for r in ranks}
        )

    def sent_kind(self, rank: int, kind: str, p: int) -> str | None:
        """The kind of pass p's `kind` message rank sent (a terminal is
        output or void), or None."""
        kinds = TERMINAL_KINDS if kind == TERMINAL else (kind,)
        return next((k for k in kinds if (k, p) in self.sent[rank]), None)


def wedge(trace: Trace, t: Terminals) -> Wedge | None:
    unfinished = sorted(set(t.made) - t.finished)
    if not unfinished:
        return None
    p = unfinished[0]
    waits, cause = _chain(trace, _Flows.of(trace), p)
    return Wedge(p, waits, cause, unfinished, _suspects(trace))


def _chain(trace: Trace, flows: _Flows, p: int) -> tuple[list[Wait], str]:
    if trace.world == 1:
        return [], f"rank 0 made pass {p} and never finished it{_doing(trace, 0, p)}"
    waits = [Wait(0, TERMINAL, p, trace.last_rank)]
    cur, owed = trace.last_rank, TERMINAL
    while True:
        nxt = (cur + 1) % trace.world
        kind = flows.sent_kind(cur, owed, p)
        if kind is not None:
            return waits, f"rank {cur} sent {kind} of pass {p} to rank {nxt}, never received"
        if cur == 0:
            return waits, f"rank 0 made pass {p} and sent no {owed} of it{_doing(trace, 0, p)}"
        prev = cur - 1
        missing = next(
            (k for k in ("decision", "hidden") if (k, p) not in flows.received[cur]), None
        )
        if missing is None:
            return waits, (
                f"rank {cur} received decision and hidden of pass {p} from rank {prev} "
                f"and sent nothing on{_doing(trace, cur, p)}"
            )
        waits.append(Wait(cur, missing, p, prev))
        cur, owed = prev, missing


def _doing(trace: Trace, rank: int, p: int) -> str:
    """What the rank logged about pass p, and how its log ends."""
    names = [
        e["event"]
        for e in trace.ranks.get(rank, ())
        if e.get("pass_id") == p and e.get("event") not in _QUIET
    ]
    tail = trace.ranks.get(rank) or [{}]
    said = f"; its events of pass {p}: {', '.join(names)}" if names else ""
    return f"{said}; its log ends with {tail[-1].get('event', 'nothing')}"


def _suspects(trace: Trace) -> list[str]:
    return [
        f"rank {e.get('rank')} waited {e.get('kind')} of pass {e.get('pass_id')} "
        f"from rank {e.get('peer')} for {e.get('waited_s')} s"
        for e in trace.merged()
        if e.get("event") == "wedge.suspect"
    ]


def failures(trace: Trace) -> list[str]:
    """How the ring failed, if it did: every rank's `ring.failed`, in time
    order (rank 0's names the cause its requests failed with)."""
    return [
        f"rank {e.get('rank')}: {e.get('reason')}"
        for e in trace.merged()
        if e.get("event") == "ring.failed"
    ]


def failed_first(trace: Trace) -> bool:
    """Whether the ring failed before any wait on it was suspected of a
    wedge: then its unfinished passes were cut off by the failure (a rank
    that died, a lost message found), not wedged (a failure that ends a
    wedge, such as its ranks stopped, comes after the suspicion)."""
    first = next(
        (e["event"] for e in trace.merged() if e.get("event") in ("ring.failed", "wedge.suspect")),
        None,
    )
    return first == "ring.failed"


def last_completed(trace: Trace, t: Terminals) -> dict[int, int]:
    """Per rank, the last pass it passed on (rank 0: the last whose terminal
    it received); -1 for none."""
    done = {0: max(t.finished, default=-1)}
    for rank in range(1, trace.world):
        kinds = TERMINAL_KINDS if rank == trace.last_rank else ("hidden",)
        passes = [
            e["pass_id"]
            for e in trace.events(rank, "msg.sent")
            if e.get("kind") in kinds and e.get("pass_id") is not None
        ]
        done[rank] = max(passes, default=-1)
    return done
