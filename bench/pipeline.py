"""Pipeline efficiency and event-loop stalls, measured side by side in one run.

Efficiency = tokens/s at pp 2 (one torch thread per rank) / (2 x tokens/s at
pp 1 with one thread), on a decode-heavy workload over the built-in model.
The machine's own ceiling is measured beside it: two independent one-rank
engines in two processes at once, whose summed tokens/s over 2 x pp 1 says
how much two ranks on this machine can gain at best (two vCPUs need not give
twice the throughput). The stall figure is the longest delay a 1 ms ticker on
rank 0's event loop sees while passes run (forwards run in an executor
thread). Usage:
    .venv/bin/python bench/pipeline.py [--requests 32] [--new-tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time

from ringserve import LLM, SamplingParams


def workload(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n)]


def tokens_per_s(llm: LLM, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == new for o in outs)
    return len(prompts) * new / (time.perf_counter() - began)


async def ticker(stop: asyncio.Event, period_s: float = 0.001) -> float:
    worst = 0.0
    while not stop.is_set():
        began = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, time.perf_counter() - began - period_s)
    return worst


def solo(args: argparse.Namespace) -> None:
    """One single-rank engine, started at the same moment as a twin."""
    llm = LLM(torch_threads=1, max_batch=args.requests)
    vocab = llm.tokenizer.vocab_size
    tokens_per_s(llm, workload(4, vocab, -1), 8)
    print(tokens_per_s(llm, workload(args.requests, vocab, args.seed), args.new_tokens), flush=True)
    llm.close()


def ceiling(args: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--solo", "--requests", str(args.requests),
           "--new-tokens", str(args.new_tokens)]  # fmt: skip
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
    ap.add_argument("--solo", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.solo:
        solo(args)
        return
    both = ceiling(args)
    one = LLM(torch_threads=1, max_batch=args.requests)
    two = LLM(pp_size=2, torch_threads=1, max_batch=args.requests)
    vocab = one.tokenizer.vocab_size
    tokens_per_s(one, workload(4, vocab, -1), 8)
    tokens_per_s(two, workload(4, vocab, -1), 8)
    pp1, pp2, stalls = [], [], []
    loop = two._ring.loop
    for r in range(args.rounds):
        prompts = workload(args.requests, vocab, r)
        pp1.append(tokens_per_s(one, prompts, args.new_tokens))
        stop = asyncio.Event()
        watch = asyncio.run_coroutine_threadsafe(ticker(stop), loop)
        pp2.append(tokens_per_s(two, prompts, args.new_tokens))
        loop.call_soon_threadsafe(stop.set)
        stalls.append(watch.result(timeout=10))
    one.close()
    two.close()
    best1, best2 = max(pp1), max(pp2)
    print(
        f"{args.requests} requests x {args.new_tokens} new tokens, 16-token prompts, one thread per rank"
    )
    print(f"  pp 1: {best1:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in pp1)})")
    print(f"  pp 2: {best2:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in pp2)})")
    print(f"  pipeline efficiency pp2 / (2 x pp1) = {best2 / (2 * best1):.2f} (goal >= 0.8)")
    print(
        f"  machine ceiling: two independent 1-rank engines at once = {both:.1f} tok/s, "
        f"{both / (2 * best1):.2f} of 2 x pp1; the ring reaches {best2 / both:.2f} of it"
    )
    print(
        f"  longest rank-0 loop stall during pp 2 passes: {max(stalls) * 1e3:.1f} ms (goal < 20 ms)"
    )


if __name__ == "__main__":
    main()
