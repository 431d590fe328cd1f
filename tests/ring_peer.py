"""One rank of a ring test, run as a child process by tests/test_ring_links.py:

    python tests/ring_peer.py --rank R --world W --port P --scenario NAME

Each rank links to its successor and from its predecessor on one tag and
plays its part of the scenario. Everything it reports goes to stdout as JSON
lines: structlog events (`wedge.suspect`, `link.failed`, ...) and `peer.*`
records the test reads. `--expect` gives this rank's links the expectation
`announces` (a Decision announces its Hidden's tensor). `--drop-handles` mutates this process only: its
SendLink drops every Work handle right after posting (the defect the link's
retention prevents); nothing in the product can switch that on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
import torch
import uvloop

from ringserve.ring.codec import FrameError, TensorSpec
from ringserve.ring.errors import LinkError
from ringserve.ring.group import close_group, init_group
from ringserve.ring.inbox import Inbox
from ringserve.ring.messages import Control, ControlKind, Decision, Entry, Hidden, Message, Output
from ringserve.ring.recv_link import RecvLink
from ringserve.ring.send_link import SendLink
from ringserve.ring.watchdog import Liveness, Owed, watched

TAG = 3
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)
FIFO_PASSES = 12
WIDTH = 8


def announces(msg: Message) -> list[TensorSpec]:
    """As the engine's: a Decision fixes its Hidden's (tokens, width) shape."""
    if not isinstance(msg, Decision):
        return []
    return [TensorSpec(torch.float32, (sum(len(e.tokens) for e in msg.entries), WIDTH))]


def decision(pass_id: int, tokens: int) -> Decision:
    entry = Entry(pass_id, 0, list(range(100_000, 100_000 + tokens)), list(range(tokens)), True)
    return Decision(pass_id, 0, [], [entry], [])


def hidden_states(pass_id: int, tokens: int) -> torch.Tensor:
    return torch.arange(tokens * WIDTH, dtype=torch.float32).reshape(tokens, WIDTH) + pass_id


def report(event: str, **fields: object) -> None:
    # one write per line: link threads log to the same stdout meanwhile
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def pass_tensors(pass_id: int) -> tuple[torch.Tensor, ...]:
    """The tensors Hidden(pass_id) carries in the fifo scenario: every dtype in
    turn, a non-contiguous view, a second tensor, and scalar/empty shapes."""
    gen = torch.Generator().manual_seed(pass_id)
    dtype = DTYPES[pass_id % len(DTYPES)]
    base = torch.randn(3, 5, 2, generator=gen) * 50
    hidden = base.to(dtype) if dtype.is_floating_point else base.to(torch.int64).to(dtype)
    if pass_id % 3 == 1:
        hidden = hidden.transpose(0, 1)  # travels as a contiguous copy
    tensors = (hidden, torch.arange(pass_id + 1, dtype=torch.int64))
    if pass_id == FIFO_PASSES - 1:
        tensors += (torch.tensor(2.5), torch.empty(0, 4))
    return tensors


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


@dataclass
class Peer:
    rank: int
    world: int
    inbox: Inbox
    health: Liveness
    send: SendLink
    recv: RecvLink | None
    expect: Callable[[Message], list[TensorSpec]] | None = None

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    def open_recv(self) -> None:
        self.recv = RecvLink(self.prev, TAG, self.inbox, expect=self.expect)

    async def close(self) -> bool:
        """Close both links; whether every link thread stopped."""
        await self.send.close(timeout_s=1.0)
        if self.recv is not None:
            await self.recv.close(timeout_s=1.0)
        return self.send.stopped and (self.recv is None or self.recv.stopped)


async def fifo(peer: Peer) -> None:
    """Decision, Hidden (tensors) and Output round a ring of 3, in order."""
    errors, seen = [], []
    if peer.rank == 0:
        for p in range(FIFO_PASSES):
            await peer.send.send(Decision(p, p % 2, [], [], []))
            await peer.send.send(Hidden(p), pass_tensors(p))
        for p in range(FIFO_PASSES):
            out = await peer.inbox.terminal()
            seen.append(out.pass_id)
            if out.tokens != [p, peer.world - 1]:
                errors.append(f"output {out.pass_id} carries {out.tokens}")
    else:
        for p in range(FIFO_PASSES):
            decision, _ = await peer.inbox.get(Decision)
            hidden, tensors = await peer.inbox.get(Hidden)
            seen.append(hidden.pass_id)
            if (decision.pass_id, hidden.pass_id) != (p, p):
                errors.append(f"expected pass {p}, got {decision.pass_id}/{hidden.pass_id}")
            if not same(tensors, tuple(t.contiguous() for t in pass_tensors(p))):
                errors.append(f"tensors of pass {p} differ")
            if peer.rank == peer.world - 1:
                await peer.send.send(Output(p, [p, peer.rank]))
            else:
                await peer.send.send(decision)
                await peer.send.send(hidden, tensors)
    report("peer.result", rank=peer.rank, seen=seen, errors=errors)


async def dispatch(peer: Peer) -> None:
    """A Hidden arriving while Control is awaited must not satisfy it."""
    if peer.rank == 0:
        await peer.send.send(Hidden(7), (torch.arange(4.0),))
        await asyncio.sleep(0.5)
        await peer.send.send(Control(ControlKind.HEARTBEAT, seq=1))
        return
    control, _ = await peer.inbox.get(Control)
    hidden_pending = peer.inbox.pending(Hidden)
    hidden, tensors = await peer.inbox.get(Hidden)
    report(
        "peer.result",
        control=[str(control.kind), control.seq],
        hidden_pending=hidden_pending,
        hidden=hidden.pass_id,
        tensor=tensors[0].tolist(),
    )


# Passes of the announced scenario: (tokens, what rank 0 sends as the Hidden).
# Pass 2's decision overflows the head; pass 4's Hidden is never sent, so its
# announced receive is filled by the shutdown.
ANNOUNCED = {0: (2, "tensor"), 1: (3, "void"), 2: (2000, "tensor"), 3: (1, "tensor"), 4: (5, None)}


async def announced(peer: Peer) -> None:
    """Hiddens whose tensors were announced by their decisions, two ahead."""
    if peer.rank == 0:
        refused = []
        for p in (0, 1):
            await peer.send.send(decision(p, ANNOUNCED[p][0]))
        await peer.send.send(Hidden(0), (hidden_states(0, 2),))
        await peer.send.send(Control(ControlKind.HEARTBEAT, seq=1))
        await peer.send.send(Hidden(1, void="injected", void_rank=0))
        for p in (2, 3, 4):
            await peer.send.send(decision(p, ANNOUNCED[p][0]))
        await peer.send.send(Hidden(2), (hidden_states(2, 2000),))
        for bad in ((hidden_states(3, 2),), (hidden_states(3, 1).double(),)):
            try:
                await peer.send.send(Hidden(3), bad)
            except FrameError as exc:
                refused.append(str(exc))
        try:
            await peer.send.send(Hidden(4), (hidden_states(4, 5),))  # out of its turn
        except FrameError as exc:
            refused.append(str(exc))
        await peer.send.send(Hidden(3), (hidden_states(3, 1),))
        report("peer.result", refused=refused, in_flight=peer.send.in_flight)
        return
    got = {}
    for p in range(len(ANNOUNCED)):
        d, _ = await peer.inbox.get(Decision)
        got[p] = {"decision": d == decision(p, ANNOUNCED[p][0])}
    for p in range(4):
        h, tensors = await peer.inbox.get(Hidden)
        tokens, kind = ANNOUNCED[p]
        want = (hidden_states(p, tokens),) if kind == "tensor" else ()
        got[p].update(pass_id=h.pass_id, void=h.void, tensors=same(tensors, want))
    control, _ = await peer.inbox.get(Control)
    assert peer.recv is not None
    closed = await peer.recv.close(timeout_s=10.0)
    report("peer.result", got=got, control=control.seq, closed=closed)


# Passes of the held scenario: tokens of each decision (pass 3's overflows
# the head on its own).
HELD = {0: 2, 1: 3, 2: 1, 3: 2000, 4: 5}


async def held(peer: Peer) -> None:
    """Held messages ride ahead in the next frame posted, as the engine
    sends its decisions: with a Hidden, a Control, a flush, the shutdown."""
    if peer.rank == 0:
        link, steps, refused = peer.send, {}, []
        await link.send(decision(0, HELD[0]), hold=True)
        steps["held"] = [link.held, link.sent_bytes]
        await link.send(Hidden(0), (hidden_states(0, HELD[0]),))
        steps["hidden"] = [link.held, link.sent_bytes]
        await peer.inbox.get(Control)  # rank 1 has counted what came with it
        for p in (1, 2):
            await link.send(decision(p, HELD[p]), hold=True)
        await link.send(Control(ControlKind.HEARTBEAT, seq=1))
        steps["control"] = [link.held, link.sent_bytes]
        await peer.inbox.get(Control)
        await link.send(Hidden(1), (hidden_states(1, HELD[1]),))
        await link.send(Hidden(2, void="injected", void_rank=0))
        before = link.sent_bytes
        await link.send(decision(3, HELD[3]), hold=True)
        await link.flush()
        steps["flushed"] = [link.held, link.sent_bytes - before]
        await link.send(Hidden(3), (hidden_states(3, HELD[3]),))
        for bad, tensors in (
            (Hidden(9), ()),
            (Control(ControlKind.SHUTDOWN, rank=0), ()),
            (Control(ControlKind.HEARTBEAT, seq=2), (torch.zeros(1),)),
        ):
            try:
                await link.send(bad, tensors, hold=True)
            except ValueError as exc:
                refused.append(str(exc))
        await link.send(decision(4, HELD[4]), hold=True)  # rides with the SHUTDOWN
        report("peer.result", steps=steps, refused=refused, held=link.held)
        return
    inbox, got = peer.inbox, {}
    _, first = await inbox.get(Hidden)
    got["with_hidden"] = inbox.pending(Decision)
    await peer.send.send(Control(ControlKind.READY, rank=1))
    await inbox.get(Control)
    got["with_control"] = inbox.pending(Decision)
    await peer.send.send(Control(ControlKind.READY, rank=1))
    decisions = [(await inbox.get(Decision))[0] for _ in range(4)]
    hiddens = [await inbox.get(Hidden) for _ in range(3)]
    got["decisions"] = [d == decision(p, HELD[p]) for p, d in enumerate(decisions)]
    want = [(hidden_states(p, HELD[p]),) if p != 2 else () for p in range(4)]
    got["hiddens"] = [same(first, want[0])] + [
        h.pass_id == p and same(t, want[p]) for p, (h, t) in enumerate(hiddens, start=1)
    ]
    last, _ = await inbox.get(Decision)
    got["last"] = last == decision(4, HELD[4])
    assert peer.recv is not None
    got["closed"] = await peer.recv.close(timeout_s=10.0)
    report("peer.result", **got)


async def desync(peer: Peer) -> None:
    """Rank 0 announces tensors that rank 1 does not expect: rank 1 must fail
    loudly, not read the tensor as the next head."""
    if peer.rank == 0:
        await peer.send.send(decision(0, 2))
        await peer.send.send(Hidden(0), (hidden_states(0, 2),))
        await peer.send.send(Hidden(1), (torch.zeros(4),))
        return
    d, _ = await peer.inbox.get(Decision)
    try:
        await peer.inbox.get(Hidden)
        error = None
    except LinkError as exc:
        error = str(exc)
    report("peer.result", decision=d.pass_id, error=error)


class Ticker:
    """Counts event-loop ticks and the longest gap between them."""

    def __init__(self) -> None:
        self.ticks, self.max_gap = 0, 0.0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            self.ticks, self.max_gap = self.ticks + 1, max(self.max_gap, now - last)
            last = now

    def stop(self) -> dict[str, float]:
        self._task.cancel()
        return {"ticks": self.ticks, "max_gap": self.max_gap}


async def backpressure(peer: Peer) -> None:
    """Sends beyond max_in_flight wait until the late receiver reads."""
    if peer.rank == 1:
        await asyncio.sleep(1.5)
        report("peer.reading", at=time.monotonic())
        peer.open_recv()
        for _ in range(5):
            await peer.inbox.get(Hidden)
        return
    ticker, returned, in_flight = Ticker(), [], []
    for p in range(5):
        await peer.send.send(Hidden(p), (torch.full((64,), float(p)),))
        returned.append(time.monotonic())
        in_flight.append(peer.send.in_flight)
    report("peer.result", returned=returned, in_flight=in_flight, **ticker.stop())


async def kill(peer: Peer) -> None:
    """Rank 1 is SIGKILLed by the test while rank 0 waits for an Output from it
    and has a send posted that rank 1 never receives (it opens no reader):
    both must end in LinkError, not hang."""
    if peer.rank == 1:
        report("peer.ready")
        await asyncio.sleep(3600)
    await peer.send.send(Hidden(0), (torch.zeros(1024),))
    report("peer.waiting", at=time.monotonic(), in_flight=peer.send.in_flight)
    try:
        await watched(peer.inbox.terminal(), Owed(0, Output, 1), 30.0, peer.health)
    except LinkError as exc:
        report("peer.get_failed", at=time.monotonic(), peer=exc.peer, error=str(exc))
    for name, attempt in (("flush", peer.send.flush), ("send", lambda: peer.send.send(Hidden(1)))):
        try:
            await attempt()
        except LinkError as exc:
            report("peer.send_failed", op=name, peer=exc.peer, error=str(exc))
    report("peer.result", health=peer.health.reason)


async def retention(peer: Peer) -> None:
    """Rank 0 sends before rank 1 posts its receive; only a retained handle
    survives that. Rank 1 watches the wait and answers READY either way."""
    if peer.rank == 0:
        await peer.send.send(Hidden(0), (torch.arange(8.0),))
        try:  # a dropped handle wedges the whole gloo pair, both directions
            await watched(peer.inbox.get(Control), Owed(0, Control, 1), 10.0, peer.health)
        except LinkError as exc:
            report("peer.gone", peer=exc.peer)
        return
    await asyncio.sleep(3.0)  # long enough for rank 0 to have sent, on a loaded machine too
    peer.open_recv()
    owed = watched(peer.inbox.get(Hidden), Owed(0, Hidden, 0), 0.5, peer.health)
    task = asyncio.ensure_future(owed)
    await asyncio.wait((task,), timeout=1.5)
    reason_while_waiting = peer.health.reason
    done, _ = await asyncio.wait((task,), timeout=1.0)
    delivered = bool(done) and task.exception() is None
    if not done:
        task.cancel()
    report(
        "peer.result", delivered=delivered, reason=reason_while_waiting, healthy=peer.health.healthy
    )
    await peer.send.send(Control(ControlKind.READY, rank=1))


def sized_tensor(pass_id: int) -> torch.Tensor:
    """Hidden(pass_id)'s tensor in the sizes scenario: in turn 64 bytes, 20 KB
    and 400 KB, so small frames follow big ones back to back."""
    numel = (16, 5000, 100_000)[pass_id % 3]
    return torch.arange(numel, dtype=torch.float32) + pass_id


async def sizes(peer: Peer) -> None:
    """Frames of every size back to back arrive in send order, each with
    its own tensor."""
    if peer.rank == 0:
        for p in range(SIZED_PASSES):
            await peer.send.send(Hidden(p), (sized_tensor(p),))
        return
    order, errors = [], []
    for _ in range(SIZED_PASSES):
        hidden, tensors = await peer.inbox.get(Hidden)
        order.append(hidden.pass_id)
        if not same(tensors, (sized_tensor(hidden.pass_id),)):
            errors.append(f"tensors of pass {hidden.pass_id} differ")
    report("peer.result", order=order, errors=errors)


SIZED_PASSES = 60


async def ticker(peer: Peer) -> None:
    """The loop keeps ticking while a large receive is pending."""
    if peer.rank == 0:
        await asyncio.sleep(1.0)
        await peer.send.send(Hidden(0), (torch.ones(4 << 20),))  # 16 MiB
        return
    tick = Ticker()
    started = time.monotonic()
    _, tensors = await peer.inbox.get(Hidden)
    waited = time.monotonic() - started
    report("peer.result", waited=waited, numel=tensors[0].numel(), **tick.stop())


SCENARIOS: dict[str, Callable[[Peer], Awaitable[None]]] = {
    f.__name__: f
    for f in (fifo, dispatch, backpressure, kill, retention, ticker, announced, held, desync, sizes)
}


def drop_handles() -> None:
    """The mutation: post each message's sends and drop their handles (and
    buffers) at once, reporting nothing to wait on."""

    def post_and_drop(self, out):
        for buf, tag in out.parts:
            self._group.send([buf.clone()], self.peer, tag)
        return [], None

    SendLink._post = post_and_drop


async def main(args: argparse.Namespace) -> None:
    init_group(args.rank, args.world, "127.0.0.1", args.port, connect_timeout_s=30.0)
    inbox = Inbox()
    expect = announces if args.expect else None
    nxt = (args.rank + 1) % args.world
    send = SendLink(nxt, TAG, args.max_in_flight, inbox=inbox, expect=expect)
    peer = Peer(args.rank, args.world, inbox, Liveness(args.rank), send, None, expect)
    if args.scenario not in ("backpressure", "retention", "kill") or args.rank == 0:
        peer.open_recv()
    await SCENARIOS[args.scenario](peer)
    if not await peer.close():
        # a link thread still blocked in gloo would abort a normal exit
        report("peer.exit", rank=args.rank, abrupt=True)
        sys.stdout.flush()
        os._exit(0)
    close_group()
    report("peer.exit", rank=args.rank)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--max-in-flight", type=int, default=2)
    parser.add_argument("--drop-handles", action="store_true")
    parser.add_argument("--expect", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    cli = parse_args()
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        # one write per line (print writes a line and its newline apart)
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
    )
    if cli.drop_handles:
        drop_handles()
    (uvloop.run if cli.loop == "uvloop" else asyncio.run)(main(cli))
