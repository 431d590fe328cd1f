"""What `ringserve replay` found, as data (for `--json` and tests) and as a
summary a person reads."""

from __future__ import annotations

from dataclasses import dataclass, field

CHECKS = ("logs", "decisions", "messages", "terminals", "rerun")


@dataclass(frozen=True, slots=True)
class Finding:
    """One inconsistency. `check` is one of CHECKS; `kind` names what is
    wrong (`decision.digest_mismatch`, `message.unmatched_send`, ...)."""

    check: str
    kind: str
    message: str
    rank: int | None = None
    pass_id: int | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """Rank `rank` waits the `kind` message of pass `pass_id` from `peer`."""

    rank: int
    kind: str
    pass_id: int
    peer: int

    def describe(self) -> str:
        return f"rank {self.rank} waits {self.kind} of pass {self.pass_id} from rank {self.peer}"


@dataclass(slots=True)
class Wedge:
    """Where a run that did not finish every pass stood at its end: the
    wait-for chain of the oldest pass without a terminal and where it ends."""

    pass_id: int
    waits: list[Wait]
    cause: str
    unfinished: list[int]
    suspects: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RerunSummary:
    """What the scheduler re-run replayed; `reproduced` is true when every
    recorded decision (and every empty schedule) came out the same."""

    arrivals: int = 0
    terminals: int = 0
    aborts: int = 0
    decisions: int = 0
    empty_schedules: int = 0
    reproduced: bool = False


@dataclass(slots=True)
class Report:
    """Invariant: `consistent` is true exactly when there is no finding."""

    log_dir: str
    world: int
    passes: int
    requests: int
    messages: int
    findings: list[Finding] = field(default_factory=list)
    wedge: Wedge | None = None
    last_completed: dict[int, int] = field(default_factory=dict)
    rerun: RerunSummary = field(default_factory=RerunSummary)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # each rank's `ring.failed`, in time order
    cut_off: bool = False  # the ring failed before any wedge was suspected (`chain.failed_first`)

    @property
    def consistent(self) -> bool:
        return not self.findings

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def render(self) -> str:
        head = (
            f"ringserve replay {self.log_dir}: {self.world} ranks, {self.passes} passes, "
            f"{self.requests} requests, {self.messages} messages"
        )
        lines = [head, *(f"  note: {n}" for n in self.notes)]
        lines += [self._check_line(check) for check in CHECKS]
        lines += [f"  ring failed: {f}" for f in self.failures]
        if self.wedge is not None:
            lines += self._wedge_lines(self.wedge)
        verdict = (
            "consistent" if self.consistent else f"INCONSISTENT: {len(self.findings)} finding(s)"
        )
        return "\n".join([*lines, verdict])

    def _check_line(self, check: str) -> str:
        found = [f for f in self.findings if f.check == check]
        if not found:
            return f"  {check:<10} ok{self._ok_detail(check)}"
        shown = [f"  {check:<10} {found[0].message}"]
        shown += [f"  {'':<10} {f.message}" for f in found[1:8]]
        if len(found) > 8:
            shown.append(f"  {'':<10} ... and {len(found) - 8} more")
        return "\n".join(shown)

    def _ok_detail(self, check: str) -> str:
        r = self.rerun
        return {
            "decisions": f": every rank applied passes 0..{self.passes - 1} in order, "
            "digests equal to rank 0's",
            "messages": ": every send has its receive",
            "terminals": ": every pass has exactly one",
            "rerun": f": {r.decisions} decisions and {r.empty_schedules} empty schedules "
            f"reproduced from {r.arrivals} arrivals, {r.terminals} terminals, {r.aborts} aborts",
        }.get(check, "")

    def _wedge_lines(self, wedge: Wedge) -> list[str]:
        ended = "cut off by the ring's failure" if self.cut_off else "wedged"
        lines = [
            f"  {ended} at pass {wedge.pass_id} (passes without a terminal: {wedge.unfinished})"
        ]
        lines += [f"    {w.describe()}" for w in wedge.waits]
        lines.append(f"    {wedge.cause}")
        done = ", ".join(f"rank {r}: {p}" for r, p in sorted(self.last_completed.items()))
        lines.append(f"  last pass completed: {done}")
        lines += [f"  wedge.suspect: {s}" for s in wedge.suspects]
        return lines
