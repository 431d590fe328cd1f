"""`ringserve replay LOGDIR`: check a run from its per-rank JSON logs
(DESIGN §7). It merges the files and checks that

(a) every rank applied every pass in order, with rank 0's decision digest;
(b) every message sent on a link was received on it, and every pass has
    exactly one terminal (Output or Void received by rank 0);
(c) for a run that ended with passes unfinished (wedged or cut off), it
    prints the wait-for chain and the last pass each rank completed, and
    how the ring failed where a rank logged that it did (`ring.failed`);
(d) a fresh scheduler fed rank 0's recorded arrivals, terminals and aborts
    reproduces every recorded decision (digest equality).

Exit 0 when consistent, 1 when not; `--json` prints the report as JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from ringserve.replay.chain import failed_first, failures, last_completed, wedge
from ringserve.replay.checks import check_decisions, check_messages, check_terminals, terminals
from ringserve.replay.report import Finding, Report, Wait, Wedge
from ringserve.replay.rerun import rerun_scheduler
from ringserve.replay.trace import load

__all__ = ["Finding", "Report", "Wait", "Wedge", "main", "replay"]


def replay(*log_dirs: str | Path) -> Report:
    """Check the run logged under `log_dirs` (one directory, or one per
    node of a ring over several). Raises ValueError when there is no rank
    log there."""
    trace = load(*log_dirs)
    t = terminals(trace)
    message_findings, messages = check_messages(trace)
    summary, rerun_findings = rerun_scheduler(trace)
    findings = [
        *trace.problems,
        *check_decisions(trace, t),
        *message_findings,
        *check_terminals(t),
        *rerun_findings,
    ]
    return Report(
        log_dir=trace.log_dir,
        world=trace.world,
        passes=len(t.made),
        requests=len(trace.events(0, "request.arrival")),
        messages=messages,
        findings=findings,
        wedge=wedge(trace, t),
        last_completed=last_completed(trace, t),
        rerun=summary,
        notes=trace.notes,
        failures=failures(trace),
        cut_off=failed_first(trace),
    )


def main(args: argparse.Namespace) -> int:
    """The `replay` subcommand: `args.log_dirs`, `args.json`."""
    report = replay(*args.log_dirs)
    if getattr(args, "json", False):
        doc = {"consistent": report.consistent, **msgspec.to_builtins(report)}
        print(msgspec.json.format(msgspec.json.encode(doc), indent=2).decode())
    else:
        print(report.render())
    return 0 if report.consistent else 1
