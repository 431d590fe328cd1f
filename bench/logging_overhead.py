"""Cost of the per-rank JSON logs: a pp 3 offline LLM with and without a log dir.

    .venv/bin/python bench/logging_overhead.py [--rounds 4] [--prompts 8] [--tokens 32]

Each round starts a fresh `LLM(pp_size=3)` over the built-in model without a
log dir and one with a log dir (which goes first alternates between rounds,
so drift on a shared machine falls on both), runs one untimed warm-up
generate, then `--repeats` timed ones. tokens/s is generated tokens over wall
time; CPU ms per pass is the CPU time of all three rank processes over the
timed generates, less sensitive than wall time to other work on the machine.
The table has one row per round and the medians.

On a shared machine the end-to-end figures are noisy, so the script also
measures the cost bound directly: microseconds per JSON event written and
per event filtered out, the digest of the largest decision, and the events
per pass each rank wrote in the logged run; their product against the
measured milliseconds per pass is what the logs can add at most per rank.
That cost is also measured by re-logging every event a rank recorded, with
its recorded fields, through a fresh JSON log.

Every rank runs one torch thread (OMP_NUM_THREADS=1, inherited by the rank
processes): spinning intra-op threads of three processes on a small machine
add more noise than the logs cost.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import structlog

from ringserve import LLM, SamplingParams, logs
from ringserve.ring.messages import Decision

RING = dict(pp_size=3, layer_split=[2, 1, 1], chunk_size=64, max_tokens_per_pass=256)


class Figures(NamedTuple):
    tokens_per_s: float
    ms_per_pass: float
    cpu_ms_per_pass: float


def workload(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 10 for j in range(24)] for i in range(n)]


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of processes (Linux /proc)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(
    log_dir: str | None, prompts: list[list[int]], params: SamplingParams, repeats: int
) -> Figures:
    """Figures of `repeats` generates on a fresh ring, after a warm-up."""
    llm = LLM(log_dir=log_dir, **RING)
    try:
        children = [proc.pid for proc in llm._ring.children.procs.values()]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: first-touch allocations, caches
        passes_before = llm._ring.conductor.metrics.passes
        began, cpu_began = time.perf_counter(), time.process_time() + cpu_s(children)
        tokens = 0
        for _ in range(repeats):
            tokens += sum(len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
        wall = time.perf_counter() - began
        cpu = time.process_time() + cpu_s(children) - cpu_began
        passes = max(llm._ring.conductor.metrics.passes - passes_before, 1)
    finally:
        llm.close()
    return Figures(tokens / wall, wall * 1e3 / passes, cpu * 1e3 / passes)


def per_event_us(log_dir: Path | None, n: int = 20000) -> float:
    scope = logs.LogScope(0, log_dir)
    log = structlog.get_logger("bench.logs")
    try:
        began = time.perf_counter()
        for i in range(n):
            log.debug("msg.sent", kind="hidden", bytes=33075, peer=1, pass_id=i)
        return (time.perf_counter() - began) / n * 1e6
    finally:
        scope.close()


def relogged_us_per_pass(log_dir: Path) -> dict[int, float]:
    """Per rank: microseconds to log again, through a fresh JSON log, every
    event the rank recorded (with its recorded fields), per pass."""
    passes = sum(1 for line in (log_dir / "rank0.jsonl").open() if '"decision.made"' in line)
    log = structlog.get_logger("bench.logs")
    cost = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        recorded = [json.loads(line) for line in path.read_text().splitlines()]
        calls = [(e.pop("level"), e.pop("event"), e) for e in recorded]
        for e in recorded:
            e.pop("rank", None), e.pop("t", None)
        scope = logs.LogScope(0, Path(tempfile.mkdtemp(prefix="ringserve-logs-")))
        try:
            began = time.perf_counter()
            for level, event, fields in calls:
                getattr(log, level)(event, **fields)  # binds per call, as module loggers do
            cost[int(path.stem.removeprefix("rank"))] = (time.perf_counter() - began) * 1e6
        finally:
            scope.close()
    return {rank: us / max(passes, 1) for rank, us in cost.items()}


def digest_us(decision: Decision, n: int = 5000) -> float:
    began = time.perf_counter()
    for _ in range(n):
        decision.digest()
    return (time.perf_counter() - began) / n * 1e6


def events_per_pass(log_dir: Path) -> tuple[dict[int, float], Decision | None]:
    """Lines per pass in each rank's log, and the largest recorded decision."""
    per_rank, largest = {}, (0, None)
    passes = sum(1 for line in (log_dir / "rank0.jsonl").open() if '"decision.made"' in line)
    for path in sorted(log_dir.glob("rank*.jsonl")):
        lines = path.read_text().splitlines()
        per_rank[int(path.stem.removeprefix("rank"))] = len(lines) / max(passes, 1)
        for line in lines:
            if '"decision.made"' in line and len(line) > largest[0]:
                largest = (len(line), json.loads(line)["decision"])
    content = largest[1]
    return per_rank, None if content is None else msgspec.convert(content, Decision)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    logs.configure(0, None, console_level="warning")
    prompts = workload(args.prompts)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rows, last_dir = [], None
    for r in range(args.rounds):
        result = {}
        for logged in (False, True) if r % 2 == 0 else (True, False):
            log_dir = tempfile.mkdtemp(prefix="ringserve-logs-") if logged else None
            result[logged] = measure(log_dir, prompts, params, args.repeats)
            last_dir = Path(log_dir) if log_dir is not None else last_dir
        rows.append((result[False], result[True]))
    print_table(rows)
    print_bound(last_dir, statistics.median(f.ms_per_pass for row in rows for f in row))


def print_table(rows: list[tuple[Figures, Figures]]) -> None:
    head = ("round", "off tok/s", "on tok/s", "slower", "off cpu ms/pass", "on cpu ms/pass", "more")
    print("{:>6}  {:>9}  {:>9}  {:>7}  {:>15}  {:>14}  {:>7}".format(*head))
    for name, (off, on) in [*enumerate(rows), ("median", _medians(rows))]:
        slower = (off.tokens_per_s - on.tokens_per_s) / off.tokens_per_s
        more = (on.cpu_ms_per_pass - off.cpu_ms_per_pass) / off.cpu_ms_per_pass
        print(
            f"{name:>6}  {off.tokens_per_s:>9.1f}  {on.tokens_per_s:>9.1f}  {slower:>7.1%}  "
            f"{off.cpu_ms_per_pass:>15.2f}  {on.cpu_ms_per_pass:>14.2f}  {more:>7.1%}"
        )


def _medians(rows: list[tuple[Figures, Figures]]) -> tuple[Figures, Figures]:
    def median(side: int) -> Figures:
        return Figures(*(statistics.median(row[side][i] for row in rows) for i in range(3)))

    return median(0), median(1)


def print_bound(log_dir: Path | None, ms_per_pass: float) -> None:
    if log_dir is None:
        return
    written = per_event_us(Path(tempfile.mkdtemp(prefix="ringserve-logs-")))
    filtered = per_event_us(None)
    per_rank, decision = events_per_pass(log_dir)
    digest = digest_us(decision) if decision is not None else 0.0
    print(f"\nper JSON event written {written:.1f} us, filtered {filtered:.2f} us; ", end="")
    print(f"digest of the largest decision {digest:.1f} us; {ms_per_pass:.2f} ms per pass")
    relogged = relogged_us_per_pass(log_dir)
    for rank, n in sorted(per_rank.items()):
        cost = relogged[rank] + (2 if rank == 0 else 1) * digest
        print(
            f"rank {rank}: {n:.1f} events per pass, re-logged in {relogged[rank]:.0f} us "
            f"+ digests -> {cost:.0f} us, {cost / (ms_per_pass * 1e3):.2%} of a pass"
        )


if __name__ == "__main__":
    main()
