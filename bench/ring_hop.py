"""Cost of one ring hop through the links against raw gloo send/recv.

    .venv/bin/python bench/ring_hop.py [--iters 1000]

Starts two local ranks. Rank 0 sends a `Hidden` with one float32 tensor to
rank 1, which sends it back; a hop is half that round trip. Measured three
ways: `riding`, as the engine runs a pass (the pass's `Decision`, held, rides
in the frame of its Hidden, timed with it: one head and the tensor for
both), `announced` (the Decision went ahead in a frame of its own, echoed
untimed, and announced the Hidden's tensor, so its receive is posted before
the Hidden's head arrives), and `bare` (no decision: the tensor's receive
is posted only once the head has arrived). The same tensor also goes back
and forth with bare `ProcessGroup.send/recv(...).wait()` on another tag.
Raw and link round trips alternate one by one within one run, so all see
the same machine load; the table gives median hop times and their ratios to
raw (goals for a pass's hop: <= 1.2x at 4 MiB, <= 2x at 4 KiB).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

import torch
import uvloop

from ringserve import logs
from ringserve.ring.codec import TensorSpec
from ringserve.ring.group import close_group, init_group
from ringserve.ring.inbox import Inbox
from ringserve.ring.messages import Decision, Hidden, Message
from ringserve.ring.recv_link import RecvLink
from ringserve.ring.send_link import SendLink

LINK_TAG, RAW_TAG = 1, 2
SIZES = {"4 KiB": 4 << 10, "4 MiB": 4 << 20}


def raw_hop(group, rank: int, t: torch.Tensor) -> float:
    peer, start = 1 - rank, time.perf_counter()
    if rank == 0:
        group.send([t], peer, RAW_TAG).wait()
        group.recv([t], peer, RAW_TAG).wait()
    else:
        group.recv([t], peer, RAW_TAG).wait()
        group.send([t], peer, RAW_TAG).wait()
    return (time.perf_counter() - start) / 2


async def riding_hop(send: SendLink, inbox: Inbox, rank: int, t: torch.Tensor, i: int) -> float:
    start = time.perf_counter()
    if rank == 0:
        await send.send(Decision(i, 0, [], [], []), hold=True)
        await send.send(Hidden(i), (t,))
        await inbox.get(Decision)
        await inbox.get(Hidden)
    else:
        decision, _ = await inbox.get(Decision)
        msg, tensors = await inbox.get(Hidden)
        await send.send(decision, hold=True)
        await send.send(msg, tensors)
    return (time.perf_counter() - start) / 2


async def link_hop(
    send: SendLink, inbox: Inbox, rank: int, t: torch.Tensor, i: int, announce: bool
) -> float:
    if announce and rank == 0:  # the decision goes ahead of the pass, untimed
        await send.send(Decision(i, 0, [], [], []))
        await inbox.get(Decision)
    elif announce:
        await send.send((await inbox.get(Decision))[0])
    start = time.perf_counter()
    if rank == 0:
        await send.send(Hidden(i), (t,))
        await inbox.get(Hidden)
    else:
        msg, tensors = await inbox.get(Hidden)
        await send.send(msg, tensors)
    return (time.perf_counter() - start) / 2


async def rank_main(args: argparse.Namespace) -> None:
    logs.configure(args.rank, console_level="warning")  # no per-message events
    group = init_group(args.rank, 2, "127.0.0.1", args.port)
    spec: list[TensorSpec] = []

    def expect(msg: Message) -> list[TensorSpec]:
        return spec if isinstance(msg, Decision) else []

    inbox = Inbox()
    send = SendLink(1 - args.rank, LINK_TAG, 4, inbox=inbox, expect=expect)
    recv = RecvLink(1 - args.rank, LINK_TAG, inbox, expect=expect)
    results = {}
    for name, nbytes in SIZES.items():
        t = torch.randn(nbytes // 4)
        spec[:] = [TensorSpec.of(t)]
        times: dict[str, list[float]] = {"raw": [], "riding": [], "announced": [], "bare": []}
        for i in range(args.iters):
            times["raw"].append(raw_hop(group, args.rank, t))
            times["riding"].append(await riding_hop(send, inbox, args.rank, t, 3 * i))
            times["announced"].append(await link_hop(send, inbox, args.rank, t, 3 * i + 1, True))
            times["bare"].append(await link_hop(send, inbox, args.rank, t, 3 * i + 2, False))
        results[name] = {k: statistics.median(v) for k, v in times.items()}
    await send.close()
    await recv.close()
    close_group()
    if args.rank == 0:
        print(json.dumps(results), flush=True)


def print_table(results: dict[str, dict[str, float]], iters: int) -> None:
    print(f"ring hop, 2 local ranks, median of {iters} hops each")
    print(
        f"{'size':>6} {'raw us':>8} {'riding us':>10} {'ratio':>6} {'announced us':>13} "
        f"{'ratio':>6} {'bare us':>8} {'ratio':>6}"
    )
    for name, r in results.items():
        ride, ann, bare = (r[k] / r["raw"] for k in ("riding", "announced", "bare"))
        print(
            f"{name:>6} {r['raw'] * 1e6:8.1f} {r['riding'] * 1e6:10.1f} {ride:6.2f} "
            f"{r['announced'] * 1e6:13.1f} {ann:6.2f} {r['bare'] * 1e6:8.1f} {bare:6.2f}"
        )


def launch(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--port", str(port), "--iters", str(args.iters)]
    outs = (subprocess.PIPE, subprocess.DEVNULL)  # only rank 0 reports
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], stdout=outs[r], text=True) for r in range(2)
    ]
    try:
        out = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    print_table(json.loads(out[0].strip().splitlines()[-1]), args.iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1000, help="round trips of each kind")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is None:
        launch(args)
    else:
        uvloop.run(rank_main(args))


if __name__ == "__main__":
    main()
