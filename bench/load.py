"""Load benchmark: the async client sends streaming requests at a fixed rate
against a running server and reports time to first token and time per
output token (p50/p99) and throughput.

    .venv/bin/python bench/load.py                 # launches the built-in model, pp 1
    .venv/bin/python bench/load.py --pp 3          # ... as a 3-rank ring
    .venv/bin/python bench/load.py --url http://127.0.0.1:8000   # an existing server
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
import urllib.request

from ringserve.client import AsyncClient
from ringserve.launch.processes import free_port


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(
    client: AsyncClient, prompt: str, max_tokens: int
) -> tuple[float, list[float], int]:
    began = time.perf_counter()
    stamps: list[float] = []
    async for _ in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        stamps.append(time.perf_counter())
    ttft = stamps[0] - began
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return ttft, gaps, len(stamps)


async def drive(url: str, rate: float, duration: float, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    tasks = []
    async with AsyncClient(url) as client:
        began = time.perf_counter()
        while time.perf_counter() - began < duration:
            prompt = system + f"Question {rng.randrange(10**6)}: what is {rng.randrange(100)}?"
            tasks.append(asyncio.create_task(one_request(client, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - began
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    chunks = sum(r[2] for r in results)
    print(f"{len(results)} requests at {rate}/s for {duration:.0f} s, {max_tokens} tokens each")
    print(
        f"  time to first token   p50 {percentile(ttfts, 0.5) * 1e3:7.1f} ms   p99 {percentile(ttfts, 0.99) * 1e3:7.1f} ms"
    )
    print(
        f"  time per output token p50 {percentile(gaps, 0.5) * 1e3:7.1f} ms   p99 {percentile(gaps, 0.99) * 1e3:7.1f} ms"
    )
    print(
        f"  throughput {chunks / elapsed:.1f} streamed chunks/s, mean TTFT {statistics.mean(ttfts) * 1e3:.1f} ms"
    )


def launch(pp: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ringserve", "launch", "--pp", str(pp), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else launch(args.pp)
    try:
        asyncio.run(drive(url, args.rate, args.duration, args.max_tokens, args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    main()
