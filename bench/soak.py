"""Chaos soak: a launched pp 3 server under mixed load, voids and a slow rank.

    .venv/bin/python bench/soak.py [--minutes 1] [--clients 8] [--pp 3] [--server-args "..."]

Starts `ringserve launch --pp 3 --log-dir D` on a free loopback port with
`RINGSERVE_FAULTS` voiding passes on rank 1 and slowing rank 2, then runs
`--clients` concurrent clients for `--minutes`. Each client loops over a mix:
streaming and plain completions, chat, `n > 1`, streams it drops midway (the
server must abort them and free their KV), and bad requests that must get a
4xx. At the end, once idle, it checks and prints:

* every request got its full answer or an error with a reason (lost = 0);
* the KV census: no slot held by a running request, every used slot cached;
* each rank's resident memory, sampled every few seconds, with its slope;
* `ringserve replay D` over the logs (exit code 0: consistent).

Traffic goes to 127.0.0.1 only; loops are bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp

FAULTS = "void:rank=1:every=97,slow:rank=2:ms=2"
STARTED = re.compile(r"started rank (\d+) .*pid (\d+)\)")
MAX_REQUESTS_PER_CLIENT = 10_000


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    cov = sum((t - mt) * (v - mv) for t, v in samples)
    return 60.0 * cov / var if var else 0.0


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.lost: list[str] = []

    def add(self, kind: str) -> None:
        self.outcomes[kind] += 1


async def one_request(
    session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally
) -> None:
    kind = rng.choice(
        ["complete", "stream", "chat", "chat_stream", "n2", "drop", "bad", "bad_json"]
    )
    max_tokens = rng.randint(4, 24)
    prompt = " ".join(
        rng.choice(["the", "ring", "passes", "tokens", "down", "and", "back"])
        for _ in range(rng.randint(3, 30))
    )
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
    route = "/v1/completions"
    if kind.startswith("chat"):
        route, body = (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
        )
    if kind in ("stream", "chat_stream", "drop"):
        body["stream"] = True
    if kind == "n2":
        body["n"] = 2
    if kind == "bad":
        body["max_tokens"] = -rng.randint(1, 5)
    try:
        if kind == "bad_json":
            async with session.post(url + route, data=b"{oops") as resp:
                tally.add(
                    "refused"
                    if 400 <= resp.status < 500 and "error" in await resp.json()
                    else "lost"
                )
            return
        async with session.post(url + route, json=body) as resp:
            if resp.status >= 400:
                error = (await resp.json()).get("error", {}).get("message")
                expected = kind == "bad" or resp.status == 429
                tally.add(
                    "refused" if expected and error else "error_with_reason" if error else "lost"
                )
                return
            if not body.get("stream"):
                data = await resp.json()
                reasons = [c.get("finish_reason") for c in data["choices"]]
                tally.add(
                    "answered"
                    if all(r in ("length", "stop") for r in reasons)
                    else "error_with_reason"
                )
                return
            chunks, finish = 0, None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if kind == "drop" and chunks >= 2:
                    tally.add("dropped_by_client")
                    return  # leaving the block closes the connection mid-stream
                if '"finish_reason":"' in line.replace(" ", ""):
                    finish = re.search(r'"finish_reason":\s*"([a-z_]+)', line).group(1)  # type: ignore[union-attr]
            tally.add(
                "answered"
                if finish in ("length", "stop")
                else "error_with_reason"
                if finish
                else "lost"
            )
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.add("lost")
        tally.lost.append(f"{kind}: {type(exc).__name__}: {exc}")


async def client(url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= until:
                return
            await one_request(session, url, rng, tally)


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    found = {}
    for line in text.splitlines():
        if line.startswith("ringserve_") and " " in line and "{" not in line:
            name, value = line.split(" ", 1)
            found[name.removeprefix("ringserve_")] = float(value)
    return found


async def sample_rss(pids: dict[int, int], until: float, samples: dict[int, list]) -> None:
    began = time.monotonic()
    while time.monotonic() < until:
        for rank, pid in pids.items():
            mib = rss_mib(pid)
            if mib is not None:
                samples[rank].append((time.monotonic() - began, mib))
        await asyncio.sleep(3.0)


async def soak(
    url: str, pids: dict[int, int], args: argparse.Namespace
) -> tuple[Tally, dict, dict]:
    until = time.monotonic() + args.minutes * 60
    tally, samples = Tally(), {rank: [] for rank in pids}
    rss = asyncio.create_task(sample_rss(pids, until, samples))
    await asyncio.gather(*(client(url, i, until, tally) for i in range(args.clients)))
    await rss
    for _ in range(100):  # idle: every aborted request has left
        m = await metrics(url)
        if m.get("requests_running", 1) == 0 and m.get("queue_depth", 1) == 0:
            break
        await asyncio.sleep(0.1)
    return tally, samples, m


def launch(
    args: argparse.Namespace, log_dir: Path
) -> tuple[subprocess.Popen, str, dict[int, int], list[str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "ringserve", "launch", "--pp", str(args.pp), "--port", str(port),
           "--log-dir", str(log_dir), "--max-tokens-per-pass", "256",
           *shlex.split(args.server_args)]  # fmt: skip
    env = {**os.environ, "RINGSERVE_FAULTS": args.faults}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    lines: list[str] = []
    pids: dict[int, int] = {}
    ready = threading.Event()

    def drain() -> None:  # read stderr for the whole run: an unread pipe fills up
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())
            if m := STARTED.search(line):
                pids[int(m.group(1))] = int(m.group(2))
            if "ready at" in line:
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(300):
        proc.kill()
        raise SystemExit("the server did not start:\n" + "\n".join(lines[-20:]))
    return proc, f"http://127.0.0.1:{port}", pids, lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pp", type=int, default=3)
    ap.add_argument("--faults", default=FAULTS)
    ap.add_argument(
        "--server-args",
        default="",
        help="more `ringserve launch` options, e.g. '--speculative ngram --host-kv-tokens 8192'",
    )
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="ringserve-soak-"))
    proc, url, pids, _ = launch(args, log_dir)
    try:
        tally, samples, m = asyncio.run(soak(url, pids, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    replay = subprocess.run([sys.executable, "-m", "ringserve", "replay", str(log_dir)],
                            capture_output=True, text=True)  # fmt: skip
    total = sum(tally.outcomes.values())
    print(f"soak: pp {args.pp}, {args.clients} clients, {args.minutes} min, faults {args.faults!r}")
    print(
        f"  requests {total}: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items()))
    )
    print(f"  lost: {tally.outcomes['lost']}" + "".join(f"\n    {x}" for x in tally.lost[:10]))
    held = m.get("kv_slots_used", -1) - m.get("kv_slots_cached", -1)
    print(
        f"  KV once idle: used {m.get('kv_slots_used')}, cached {m.get('kv_slots_cached')}, "
        f"free {m.get('kv_slots_free')}, held by requests {held} (want 0); "
        f"voids {m.get('voids_total')}, passes {m.get('passes_total')}"
    )
    for rank, pts in samples.items():
        first = pts[0][1] if pts else float("nan")
        last = pts[-1][1] if pts else float("nan")
        print(
            f"  rank {rank} RSS {first:.0f} -> {last:.0f} MiB, slope {slope_mib_per_min(pts):+.2f} MiB/min"
        )
    verdict = "consistent" if replay.returncode == 0 else f"FAILED (exit {replay.returncode})"
    print(f"  replay: {verdict}; logs in {log_dir}")
    if replay.returncode != 0:
        print(replay.stdout[-3000:])


if __name__ == "__main__":
    main()
