"""Where rank 0's time goes per pass, in a ring of two.

    .venv/bin/python bench/rank0.py [--requests 32] [--new-tokens 64] [--model DIR]

Rank 0 runs two threads: the event loop (scheduling, applying, encoding and
sending, taking terminals, delivering tokens, detokenising, logging) and the
forward thread (its own layers). Both compete for the GIL. This measures, in
one run:

* the loop thread's CPU time per pass, and a cProfile of it grouped by the
  part of rank 0 each function belongs to;
* rank 0's forward time per pass inside the ring, against the same forwards
  run alone afterwards on the same stage with the loop idle (the goal is
  ring / alone <= 1.1).

CPU time is per thread (`time.thread_time`), so it does not depend on what
else the machine runs; the forward ratio is wall time, measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import statistics
import time

from ringserve import LLM, SamplingParams
from ringserve.engine.replica import Row
from ringserve.engine.slot_row import SlotRow

PARTS = {  # a function's file -> the part of rank 0 it belongs to
    "sched/": "scheduling",
    "engine/replica": "applying",
    "engine/stage": "applying",
    "ring/codec": "encoding and sending",
    "ring/link": "encoding and sending",
    "ring/send_link": "encoding and sending",
    "ring/recv_link": "encoding and sending",
    "msgspec": "encoding and sending",
    "ring/inbox": "taking terminals",
    "ring/watchdog": "taking terminals",
    "engine/desk": "delivering tokens",
    "engine/handle": "delivering tokens",
    "engine/textstream": "detokenising",
    "models/tokenizer": "detokenising",
    "structlog": "logging",
    "logs.py": "logging",
    "asyncio": "event loop",
    "uvloop": "event loop",
}


def part_of(filename: str) -> str:
    return next((part for key, part in PARTS.items() if key in filename), "other")


def by_part(profile: cProfile.Profile) -> dict[str, float]:
    """Self time of every profiled function, summed per part of rank 0."""
    stats = pstats.Stats(profile)
    parts: dict[str, float] = {}
    for (filename, _, _), (_, _, self_time, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        parts[part_of(filename)] = parts.get(part_of(filename), 0.0) + self_time
    return parts


class TimedStage:
    """Wraps rank 0's stage to time each forward and keep its inputs."""

    def __init__(self, stage) -> None:
        self.stage, self.times, self.calls = stage, [], []
        self.compute_inner = stage.compute

    def compute(self, decision, rows, hidden, masks=None):
        began = time.perf_counter()
        out = self.compute_inner(decision, rows, hidden, masks)
        self.times.append(time.perf_counter() - began)
        self.calls.append((decision, [Row(r.sampling, SlotRow(r.slots.array())) for r in rows]))
        return out


async def loop_cpu(start: bool, box: dict, profile: bool) -> None:
    """Start or stop measuring the loop thread (CPU time, and a profile)."""
    if start:
        box["cpu"] = time.thread_time()
        if profile:
            box["profile"] = cProfile.Profile()
            box["profile"].enable()
    else:
        if profile:
            box["profile"].disable()
        box["cpu"] = time.thread_time() - box["cpu"]


def measured_run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, profile: bool
) -> tuple[dict, float, int]:
    """One generate with the loop thread measured: (box, wall s, passes)."""
    ring, box = llm._ring, {}
    before = ring.conductor.metrics.passes
    asyncio.run_coroutine_threadsafe(loop_cpu(True, box, profile), ring.loop).result()
    began = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - began
    asyncio.run_coroutine_threadsafe(loop_cpu(False, box, profile), ring.loop).result()
    return box, wall, ring.conductor.metrics.passes - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--top", type=int, default=0, help="also print the N costliest functions")
    ap.add_argument("--sort", default="tottime", help="their order: tottime or cumulative")
    args = ap.parse_args()
    llm = LLM(args.model, pp_size=2, torch_threads=1, max_batch=args.requests, dtype=args.dtype)
    ring = llm._ring
    conductor = ring.conductor
    vocab = llm.tokenizer.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    timed = TimedStage(conductor.stage)
    conductor.stage.compute = timed.compute
    box, wall, passes = measured_run(llm, prompts, params, profile=False)
    in_ring = list(timed.times)
    conductor.stage.compute = timed.compute_inner
    profiled, _, profiled_passes = measured_run(llm, prompts, params, profile=True)
    alone = []
    for decision, rows in timed.calls:  # the same passes, the loop idle
        began_f = time.perf_counter()
        timed.compute_inner(decision, rows, None)
        alone.append(time.perf_counter() - began_f)
    llm.close()
    tokens = args.requests * args.new_tokens
    print(
        f"pp 2, {args.requests} requests x {args.new_tokens} tokens: {tokens / wall:.1f} tok/s, {passes} passes"
    )
    print(f"  rank 0 loop thread: {box['cpu'] / passes * 1e3:.3f} ms CPU per pass")
    print(
        f"  under cProfile (a second run, {profiled_passes} passes; the profiler's own cost inflates these):"
    )
    for part, seconds in sorted(by_part(profiled["profile"]).items(), key=lambda kv: -kv[1]):
        print(f"    {part:22s} {seconds / profiled_passes * 1e3:8.3f} ms per pass")
    if args.top:
        pstats.Stats(profiled["profile"]).sort_stats(args.sort).print_stats(args.top)
    ring_ms, alone_ms = statistics.median(in_ring) * 1e3, statistics.median(alone) * 1e3
    print(
        f"  rank 0 forward: {ring_ms:.3f} ms in the ring, {alone_ms:.3f} ms alone "
        f"(same passes re-run on an idle loop): {ring_ms / alone_ms:.2f}x (goal <= 1.1)"
    )


if __name__ == "__main__":
    main()
