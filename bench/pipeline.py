"""Pipeline efficiency and event-loop stalls, measured side by side in one run.

Efficiency = tokens/s at pp N (one torch thread per rank) / (N x tokens/s at
pp 1 with one thread), on a decode-heavy workload over the built-in model or
`--model DIR`; `--passes-in-flight 2,3` runs one ring per micro-batch depth,
interleaved round by round, so the depths are compared under the same load.
The machine's own ceiling is measured beside it: two independent one-rank
engines in two processes at once, whose summed tokens/s over 2 x pp 1 says
how much two ranks on this machine can gain at best (two vCPUs need not give
twice the throughput). The stall figure is the longest delay a 1 ms ticker on
rank 0's event loop sees while passes run (forwards run in an executor
thread). Beside each ring, every stage's predicted time per pass (the
planner's ledger: layers plus the head's share, in reference-layer times)
against its measured forward time per pass and busy share (each rank's
running totals, which heartbeats bring to rank 0). Usage:
    .venv/bin/python bench/pipeline.py [--requests 32] [--new-tokens 96] [--rounds 3]
        [--pp 2] [--passes-in-flight 2,3] [--model DIR] [--dtype float32] [--device auto]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

from decode_load import tokens_per_s, workload

from ringserve import LLM


async def ticker(stop: asyncio.Event, period_s: float = 0.001) -> float:
    worst = 0.0
    while not stop.is_set():
        began = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, time.perf_counter() - began - period_s)
    return worst


def stage_totals(llm: LLM) -> dict[int, tuple[int, float]]:
    """(forwards, forward seconds) per rank, as rank 0 knows them once a
    heartbeat has been round since the last pass."""
    conductor = llm._ring.conductor
    time.sleep(1.5 * conductor.heartbeat_s)
    return {s.rank: (s.forwards, s.forward_s) for s, _ in conductor.rank_stats()}


def stage_report(llm: LLM, before: dict, after: dict, wall_s: float) -> list[str]:
    """Each stage's predicted time per pass against its measured one, both
    relative to the slowest stage, and the share of the run it computed."""
    ledger = llm.plan.ledger
    worst = max(row.stage_time for row in ledger)
    measured = {}
    for rank, (n, spent) in after.items():
        n0, spent0 = before.get(rank, (0, 0.0))
        measured[rank] = ((spent - spent0) / max(1, n - n0), spent - spent0)
    slowest = max(ms for ms, _ in measured.values()) or 1.0
    lines = []
    for row in ledger:
        per_pass, busy = measured.get(row.rank, (0.0, 0.0))
        lines.append(
            f"    rank {row.rank} layers {row.layers.start}-{row.layers.stop - 1}: predicted "
            f"{row.stage_time / worst:.2f}, measured {per_pass / slowest:.2f} of the slowest "
            f"({per_pass * 1e3:.1f} ms a pass, busy {busy / wall_s:.2f} of the run)"
        )
    return lines


def solo(args: argparse.Namespace) -> None:
    """One single-rank engine, started at the same moment as a twin."""
    llm = LLM(
        args.model,
        dtype=args.dtype,
        torch_threads=1,
        max_batch=args.max_batch,
        device=args.device,
    )
    vocab = llm._ring.conductor.vocab_size
    tokens_per_s(llm, workload(4, vocab, -1), 8)
    print(tokens_per_s(llm, workload(args.requests, vocab, args.seed), args.new_tokens), flush=True)
    llm.close()


def ceiling(args: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--solo", "--requests", str(args.requests),
           "--new-tokens", str(args.new_tokens), "--dtype", args.dtype,
           "--max-batch", str(args.max_batch), "--device", args.device]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    twins = [
        subprocess.Popen(cmd + ["--seed", str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    return sum(float(p.communicate()[0].split()[-1]) for p in twins)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument(
        "--passes-in-flight",
        default=None,
        help="depths to compare, e.g. 2,3 (default: the engine's)",
    )
    ap.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto", help="where the ranks run (default auto)")
    ap.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="rows per pass (default --requests): --requests N x (pp + 2) with --max-batch N "
        "fills every micro-batch the default depth opens (pp + 2), the saturated case, where "
        "pp 1 runs passes of the same size",
    )
    ap.add_argument("--solo", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.max_batch = args.max_batch or args.requests
    if args.solo:
        solo(args)
        return
    both = ceiling(args)
    common = dict(dtype=args.dtype, torch_threads=1, max_batch=args.max_batch, device=args.device)
    one = LLM(args.model, **common)
    depths = (
        [None]
        if args.passes_in_flight is None
        else [int(x) for x in args.passes_in_flight.split(",")]
    )
    vocab = one._ring.conductor.vocab_size
    tokens_per_s(one, workload(4, vocab, -1), 8)
    pp1: list[float] = []
    ring_rates: dict[int | None, list[float]] = {s: [] for s in depths}
    stages: dict[int | None, list[str]] = {}
    stalls: list[float] = []
    for r in range(args.rounds):
        prompts = workload(args.requests, vocab, r)
        pp1.append(tokens_per_s(one, prompts, args.new_tokens))
        for s in depths:  # one process group per process: one ring at a time
            with LLM(args.model, pp_size=args.pp, passes_in_flight=s, **common) as llm:
                tokens_per_s(llm, workload(4, vocab, -1), 8)
                before = stage_totals(llm)
                stop = asyncio.Event()
                watch = asyncio.run_coroutine_threadsafe(ticker(stop), llm._ring.loop)
                began = time.perf_counter()
                ring_rates[s].append(tokens_per_s(llm, prompts, args.new_tokens))
                wall = time.perf_counter() - began
                llm._ring.loop.call_soon_threadsafe(stop.set)
                stalls.append(watch.result(timeout=10))
                if ring_rates[s][-1] == max(ring_rates[s]):  # the best round's stages
                    stages[s] = stage_report(llm, before, stage_totals(llm), wall)
    one.close()
    best1, n = max(pp1), args.pp
    print(
        f"{args.requests} requests x {args.new_tokens} new tokens, 16-token prompts, "
        f"at most {args.max_batch} rows per pass, one thread per rank, {args.dtype}, "
        f"device {one.config.device}"
    )
    print(f"  pp 1: {best1:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in pp1)})")
    for s, rates in ring_rates.items():
        best = max(rates)
        depth = "default depth" if s is None else f"{s} passes in flight"
        print(
            f"  pp {n}, {depth}: {best:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in rates)})"
        )
        print(f"    efficiency pp{n} / ({n} x pp1) = {best / (n * best1):.2f}; "
              f"{best / both:.2f} of the machine's ceiling")  # fmt: skip
        print("\n".join(stages[s]))
    print(
        f"  machine ceiling: two independent 1-rank engines at once = {both:.1f} tok/s, "
        f"{both / (2 * best1):.2f} of 2 x pp1"
    )
    print(
        f"  longest rank-0 loop stall during ring passes: {max(stalls) * 1e3:.1f} ms (goal < 20 ms)"
    )


if __name__ == "__main__":
    main()
