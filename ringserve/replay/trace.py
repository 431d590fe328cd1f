"""The logs of one run, read back: every rank's events in file order (the
order each rank logged them), from the last `log.opened` marker on, so a log
directory reused by several runs is read as its latest run."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ringserve.replay.report import Finding

Event = dict[str, Any]
_FILE = re.compile(r"rank(\d+)\.jsonl")
_DECODER = msgspec.json.Decoder(dict[str, Any])


@dataclass(slots=True)
class Trace:
    """Invariant: `ranks[r]` holds rank r's events in the order rank r wrote
    them; `world` is the ring size rank 0 recorded (else the highest rank
    with a log, plus one)."""

    log_dir: str  # the directories read, as given
    ranks: dict[int, list[Event]]
    world: int
    notes: list[str] = field(default_factory=list)
    problems: list[Finding] = field(default_factory=list)

    def events(self, rank: int, *names: str) -> list[Event]:
        return [e for e in self.ranks.get(rank, ()) if e.get("event") in names]

    def first(self, rank: int, name: str) -> Event | None:
        return next(iter(self.events(rank, name)), None)

    @property
    def last_rank(self) -> int:
        return self.world - 1

    def merged(self) -> list[Event]:
        """Every event of every rank on one clock (monotonic, machine-wide)."""
        every = [e for events in self.ranks.values() for e in events]
        return sorted(every, key=lambda e: (e.get("t", 0.0), e.get("rank", 0)))


def load(*log_dirs: str | Path) -> Trace:
    """Read `rank*.jsonl` under each of `log_dirs` (a ring over several
    nodes logs into one directory per node). Raises ValueError when there is
    no rank log in them at all, or when one rank's log is in two of them."""
    roots = [Path(d) for d in log_dirs]
    shown = ", ".join(map(str, roots))
    files: dict[int, Path] = {}
    for root in roots:
        for path in sorted(root.glob("rank*.jsonl")):
            if (m := _FILE.fullmatch(path.name)) is None:
                continue
            rank = int(m.group(1))
            if rank in files and files[rank].resolve() != path.resolve():
                raise ValueError(
                    f"rank {rank} has a log in {files[rank].parent} and in {root}: give each "
                    "node's log directory once, one per node"
                )
            files[rank] = path
    if not files:
        raise ValueError(
            f"no rank*.jsonl logs in {shown} (serve with --log-dir DIR, or give LLM a log directory)"
        )
    notes: list[str] = []
    problems: list[Finding] = []
    ranks = {r: _read(r, files[r], notes, problems) for r in sorted(files)}
    config = next((e for e in ranks.get(0, ()) if e.get("event") == "scheduler.config"), None)
    world = int(config["world"]) if config is not None else max(ranks) + 1
    for r in range(world):
        if r not in ranks:
            where = "" if len(roots) > 1 else " (on several nodes: give every node's log directory)"
            problems.append(
                Finding("logs", "log.missing", f"rank {r} has no log in {shown}{where}", rank=r)
            )
    return Trace(shown, ranks, world, notes, problems)


def _read(rank: int, path: Path, notes: list[str], problems: list[Finding]) -> list[Event]:
    lines = path.read_bytes().splitlines()
    events: list[Event] = []
    for i, line in enumerate(lines):
        try:
            events.append(_DECODER.decode(line))
        except msgspec.DecodeError:
            if i == len(lines) - 1:  # a process cut off mid-write
                notes.append(f"rank {rank}'s log ends in a partial line (skipped)")
            else:
                message = f"{path.name} line {i + 1} is not a JSON event"
                problems.append(Finding("logs", "log.unreadable", message, rank=rank))
    runs = [i for i, e in enumerate(events) if e.get("event") == "log.opened"]
    if len(runs) > 1:
        notes.append(f"rank {rank}'s log holds {len(runs)} runs; the last one is read")
    return events[runs[-1] :] if runs else events
