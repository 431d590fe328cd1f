"""A decode pass's batch, built from a replica's rows, against the same
batch built from Python lists of slots (the replica's rows before they were
`SlotRow`s), side by side in one run, at growing contexts. Every rank builds
its pass's batch on the host, however fast its device, so on a GPU decode
pass this is host time the device waits for. Also the replica's applying of
one decode step (a slot a row) both ways. Usage:
    .venv/bin/python bench/batch_build.py [--rows 32] [--contexts 64,512,2048,8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ringserve.engine.slot_row import SlotRow
from ringserve.kernels.batch import ForwardBatch


def per_call_us(fn, calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--contexts", default="64,512,2048,8192")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b = args.rows
    print(f"decode pass of {b} rows, one thread; median of {args.repeats} interleaved repeats")
    for ctx in (int(c) for c in args.contexts.split(",")):
        med = compare(b, ctx, args.repeats)
        ratio = med["slot rows build"] / med["lists build"]
        print(
            f"  context {ctx:5d}: build {med['lists build']:7.0f} us from lists, "
            f"{med['slot rows build']:6.0f} from slot rows ({ratio:.2f}x); "
            f"apply {med['lists apply']:5.1f} us against {med['slot rows apply']:5.1f}"
        )


def compare(b: int, ctx: int, repeats: int) -> dict[str, float]:
    """Median microseconds of each way, for `b` rows of `ctx` slots."""
    lists = [list(range(1 + i * ctx, 1 + (i + 1) * ctx)) for i in range(b)]
    rows = [SlotRow(r) for r in lists]
    calls = max(5, 20_000 // ctx)
    build = {
        "lists": lambda: ForwardBatch.build(lists, [1] * b, [True] * b),
        "slot rows": lambda: ForwardBatch.build([r.array() for r in rows], [1] * b, [True] * b),
    }
    step = {  # one decode step's apply: each row cut to its context and one slot added
        "lists": lambda: [(r.__delitem__(slice(ctx, None)), r.extend([7])) for r in lists],
        "slot rows": lambda: [(r.cut(ctx), r.extend([7])) for r in rows],
    }
    times: dict[str, list[float]] = {f"{k} {w}": [] for k in build for w in ("build", "apply")}
    for _ in range(repeats):
        for k in build:
            times[f"{k} build"].append(per_call_us(build[k], calls))
            times[f"{k} apply"].append(per_call_us(step[k], calls))
    return {k: statistics.median(v) for k, v in times.items()}


if __name__ == "__main__":
    main()
