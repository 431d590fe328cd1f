"""Ring links over real gloo between real processes (tests/ring_peer.py), and
the inbox and watchdog they feed, in process. Every multi-process test runs
under a timeout and checks that no child survives it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
import torch
import uvloop

from ringserve.ring import codec
from ringserve.ring.errors import LinkError
from ringserve.ring.inbox import Inbox
from ringserve.ring.messages import Control, ControlKind, Hidden, Output, Void
from ringserve.ring.watchdog import Liveness, Owed, watched
from tests.ring_peer import ANNOUNCED, HELD, SIZED_PASSES, WIDTH

PEER = Path(__file__).with_name("ring_peer.py")
ROOT = PEER.parent.parent
CHILD_TIMEOUT_S = 45
RUNNERS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ring:
    """Child processes running one scenario, one per rank."""

    def __init__(self, tmp: Path, scenario: str, world: int, extra: dict[int, list[str]]) -> None:
        port, env = free_port(), {**os.environ, "PYTHONPATH": str(ROOT)}
        self.out = [tmp / f"rank{r}.out" for r in range(world)]
        self.err = [tmp / f"rank{r}.err" for r in range(world)]
        self.procs = []
        for r in range(world):
            argv = [sys.executable, str(PEER), "--rank", str(r), "--world", str(world)]
            argv += ["--port", str(port), "--scenario", scenario, *extra.get(r, [])]
            with self.out[r].open("w") as out, self.err[r].open("w") as err:
                self.procs.append(subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT, env=env))

    def records(self, rank: int, event: str) -> list[dict]:
        lines = self.out[rank].read_text().splitlines()
        found = [json.loads(line) for line in lines if line.startswith("{")]
        return [rec for rec in found if rec["event"] == event]

    def result(self, rank: int) -> dict:
        (rec,) = self.records(rank, "peer.result")
        return rec

    def wait_for(self, rank: int, event: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.records(rank, event):
            assert self.procs[rank].poll() is None, self.diagnostics()
            assert time.monotonic() < deadline, f"rank {rank} never logged {event}"
            time.sleep(0.05)
        return self.records(rank, event)[0]

    def finish(self) -> list[int]:
        """Wait for every child (bounded) and return their exit codes."""
        try:
            return [p.wait(timeout=CHILD_TIMEOUT_S) for p in self.procs]
        except subprocess.TimeoutExpired:
            pytest.fail(f"a rank did not exit\n{self.diagnostics()}")

    def diagnostics(self) -> str:
        return "\n".join(
            f"rank {r}:\n{o.read_text()}{e.read_text()[-2000:]}"
            for r, (o, e) in enumerate(zip(self.out, self.err, strict=True))
        )


@pytest.fixture
def ring(tmp_path: Path):
    started: list[Ring] = []

    def start(scenario: str, world: int, extra: dict[int, list[str]] | None = None) -> Ring:
        started.append(Ring(tmp_path, scenario, world, extra or {}))
        return started[-1]

    yield start
    survivors = [p for r in started for p in r.procs if p.poll() is None]
    for p in survivors:
        p.kill()
        p.wait()
    assert not survivors, f"{len(survivors)} child process(es) survived the test"


@pytest.mark.timeout(90)
def test_three_rank_ring_delivers_every_kind_in_order_with_tensors_intact(ring) -> None:
    peers = ring("fifo", 3)
    assert peers.finish() == [0, 0, 0], peers.diagnostics()
    for rank in range(3):
        result = peers.result(rank)
        assert result["errors"] == []
        assert result["seen"] == list(range(12))


@pytest.mark.timeout(60)
def test_hidden_arriving_first_does_not_satisfy_a_control_wait(ring) -> None:
    peers = ring("dispatch", 2, {0: ["--loop", "asyncio"], 1: ["--loop", "asyncio"]})
    assert peers.finish() == [0, 0], peers.diagnostics()
    result = peers.result(1)
    assert result["control"] == ["heartbeat", 1]
    assert result["hidden_pending"] == 1
    assert (result["hidden"], result["tensor"]) == (7, [0.0, 1.0, 2.0, 3.0])


@pytest.mark.timeout(60)
def test_sends_beyond_max_in_flight_wait_for_the_receiver(ring) -> None:
    peers = ring("backpressure", 2)
    assert peers.finish() == [0, 0], peers.diagnostics()
    reading_at = peers.records(1, "peer.reading")[0]["at"]
    result = peers.result(0)
    assert max(result["in_flight"]) == 2
    assert result["returned"][1] < reading_at < result["returned"][2]
    assert result["ticks"] > 20 and result["max_gap"] < 0.5  # the loop ran while send waited


@pytest.mark.timeout(60)
def test_killed_peer_fails_pending_get_and_sends_with_link_error(ring) -> None:
    peers = ring("kill", 2)
    peers.wait_for(1, "peer.ready")
    peers.wait_for(0, "peer.waiting")
    os.kill(peers.procs[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert peers.finish() == [0, -signal.SIGKILL], peers.diagnostics()
    (failed,) = peers.records(0, "peer.get_failed")
    assert failed["peer"] == 1 and "rank 1" in failed["error"]
    assert failed["at"] - killed_at < 5.0
    assert peers.records(0, "peer.waiting")[0]["in_flight"] == 1
    send_failed = peers.records(0, "peer.send_failed")
    assert [(f["op"], f["peer"]) for f in send_failed] == [("flush", 1), ("send", 1)]
    assert "rank 1" in peers.result(0)["health"]


@pytest.mark.timeout(60)
def test_retained_handles_deliver_a_send_posted_before_the_receive(ring) -> None:
    peers = ring("retention", 2)
    assert peers.finish() == [0, 0], peers.diagnostics()
    assert peers.result(1) == {
        "event": "peer.result",
        "delivered": True,
        "reason": None,
        "healthy": True,
    }
    assert peers.records(1, "wedge.suspect") == []


@pytest.mark.timeout(60)
def test_dropped_send_handles_lose_the_message_and_the_watchdog_says_so(ring) -> None:
    peers = ring("retention", 2, {0: ["--drop-handles"]})
    assert peers.finish() == [0, 0], peers.diagnostics()
    result = peers.result(1)
    assert not result["delivered"]
    assert result["reason"] == "wedged: rank 1 waits hidden of pass 0 from rank 0"
    (suspect,) = peers.records(1, "wedge.suspect")
    assert (suspect["pass_id"], suspect["kind"], suspect["peer"]) == (0, "hidden", 0)


@pytest.mark.timeout(60)
def test_event_loop_keeps_ticking_while_a_large_receive_is_pending(ring) -> None:
    peers = ring("ticker", 2)
    assert peers.finish() == [0, 0], peers.diagnostics()
    result = peers.result(1)
    assert result["numel"] == 4 << 20
    assert result["waited"] > 0.5
    assert result["ticks"] > 20 and result["max_gap"] < 0.5


@pytest.mark.timeout(60)
def test_announced_tensors_arrive_into_receives_posted_ahead(ring) -> None:
    peers = ring("announced", 2, {0: ["--expect"], 1: ["--expect", "--max-in-flight", "8"]})
    assert peers.finish() == [0, 0], peers.diagnostics()
    got = peers.result(1)
    assert got["control"] == 1 and got["closed"]  # the owed pass 4 was filled at shutdown
    for p, (_, kind) in ANNOUNCED.items():
        row = got["got"][str(p)]
        assert row["decision"], p
        if kind is not None:
            assert (row["pass_id"], row["tensors"]) == (p, True), p
            assert row["void"] == (None if kind == "tensor" else "injected")
    refused = peers.result(0)["refused"]
    assert len(refused) == 3
    assert "announced" in refused[0] and "announced" in refused[1]
    assert "out of turn" in refused[2]
    assert peers.records(1, "link.failed") == [] and peers.records(0, "link.failed") == []


@pytest.mark.timeout(60)
def test_held_messages_ride_ahead_in_the_next_frame_posted(ring) -> None:
    peers = ring("held", 2, {0: ["--expect"], 1: ["--expect", "--max-in-flight", "8"]})
    assert peers.finish() == [0, 0], peers.diagnostics()
    sent, got = peers.result(0), peers.result(1)
    head, first = codec.HEAD_BYTES, HELD[0] * WIDTH * 4
    steps = sent["steps"]
    assert steps["held"] == [1, 0]  # nothing on the wire yet
    assert steps["hidden"] == [0, head + first]  # one head for the decision and the Hidden
    assert steps["control"] == [0, 2 * head + first]  # two decisions rode with the Control
    held_alone, flushed = steps["flushed"]
    assert held_alone == 0 and head < flushed < 2 * head + HELD[3] * 50  # one overflowed frame
    assert len(sent["refused"]) == 3 and all("held message" in r for r in sent["refused"])
    assert sent["held"] == 1  # the last decision waits for the shutdown
    # delivered in send order: each decision before the message it rode with
    assert (got["with_hidden"], got["with_control"]) == (1, 3)
    assert got["decisions"] == [True] * 4 and got["hiddens"] == [True] * 4
    assert got["last"] and got["closed"]  # its announced receive was filled at shutdown
    assert peers.records(1, "link.failed") == [] and peers.records(0, "link.failed") == []


@pytest.mark.timeout(60)
def test_frames_of_every_size_arrive_in_send_order(ring) -> None:
    """Small frames right behind big ones: none overtakes another."""
    peers = ring("sizes", 2, {0: ["--max-in-flight", "16"]})
    assert peers.finish() == [0, 0], peers.diagnostics()
    got = peers.result(1)
    assert got["order"] == list(range(SIZED_PASSES)) and got["errors"] == []


@pytest.mark.timeout(60)
def test_tensors_announced_to_a_receiver_that_expects_none_fail_the_link_loudly(ring) -> None:
    peers = ring("desync", 2, {0: ["--expect"]})
    codes = peers.finish()
    result = peers.result(1)
    assert result["decision"] == 0
    assert result["error"] is not None and "rank 0" in result["error"], peers.diagnostics()
    assert "preposted=True" in result["error"]
    assert codes[1] == 0, peers.diagnostics()


# In process: the inbox and the watchdog, under both event loops.


@pytest.mark.timeout(10)
@RUNNERS
def test_inbox_get_is_only_satisfied_by_its_own_kind(run) -> None:
    async def main() -> None:
        inbox = Inbox()
        waiting = asyncio.ensure_future(inbox.get(Control))
        inbox.put(Hidden(1), (torch.ones(2),))
        inbox.put(Hidden(2))
        await asyncio.sleep(0)
        assert not waiting.done()
        inbox.put(Control(ControlKind.HEARTBEAT, seq=5))
        assert (await waiting)[0].seq == 5
        assert inbox.pending(Hidden) == 2
        first, tensors = await inbox.get(Hidden)
        assert (first.pass_id, tensors[0].tolist()) == (1, [1.0, 1.0])
        assert (await inbox.get(Hidden))[0].pass_id == 2

    run(main())


@pytest.mark.timeout(10)
@RUNNERS
def test_inbox_failure_wakes_waiters_but_delivers_what_arrived(run) -> None:
    async def main() -> None:
        inbox = Inbox()
        waiting = asyncio.ensure_future(inbox.get(Hidden))
        await asyncio.sleep(0)
        inbox.put(Output(3, [9]))
        inbox.fail(LinkError(2, "gone"))
        with pytest.raises(LinkError, match="rank 2"):
            await waiting
        assert (await inbox.terminal()).pass_id == 3
        with pytest.raises(LinkError, match="gone"):
            await inbox.terminal()

    run(main())


@pytest.mark.timeout(10)
@RUNNERS
def test_cancelled_get_does_not_swallow_a_message(run) -> None:
    async def main() -> None:
        inbox = Inbox()
        waiting = asyncio.ensure_future(inbox.get(Hidden))
        await asyncio.sleep(0)
        inbox.put(Hidden(4))
        waiting.cancel()  # handed the message and cancelled in the same tick
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (await inbox.get(Hidden))[0].pass_id == 4

    run(main())


@pytest.mark.timeout(10)
@RUNNERS
def test_overdue_wait_is_suspected_once_then_cleared_on_arrival(run) -> None:
    async def main() -> None:
        inbox, health = Inbox(), Liveness(rank=2)
        owed = Owed(812, Hidden, 1)
        with structlog.testing.capture_logs() as logs:
            waiting = asyncio.ensure_future(watched(inbox.get(Hidden), owed, 0.05, health))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # a suspicion, not a cancellation
            assert health.reason == "wedged: rank 2 waits hidden of pass 812 from rank 1"
            inbox.put(Hidden(812))
            assert (await waiting)[0].pass_id == 812
        assert health.healthy and health.reason is None
        suspects = [e for e in logs if e["event"] == "wedge.suspect"]
        assert [(e["pass_id"], e["kind"], e["peer"]) for e in suspects] == [(812, "hidden", 1)]

    run(main())


@pytest.mark.timeout(10)
@RUNNERS
def test_link_error_during_a_watched_wait_marks_health_dead(run) -> None:
    async def main() -> None:
        inbox, health = Inbox(), Liveness(rank=0)
        before = health.last_progress
        waiting = asyncio.ensure_future(watched(inbox.terminal(), Owed(5, Output, 2), 10.0, health))
        await asyncio.sleep(0)
        inbox.fail(LinkError(2, "connection closed"))
        with pytest.raises(LinkError):
            await waiting
        assert health.dead and not health.healthy and "rank 2" in health.reason
        assert health.last_progress == before

    run(main())


def test_health_stays_red_until_every_suspicion_clears() -> None:
    health = Liveness(rank=1)
    first, second = health.suspect("wedged: a"), health.suspect("wedged: b")
    health.clear(first)
    assert not health.healthy and health.reason == "wedged: b"
    health.clear(second)
    assert health.healthy
    health.mark_dead("link with rank 0 failed")
    health.mark_dead("later")
    assert health.reason == "link with rank 0 failed"


@pytest.mark.timeout(10)
@RUNNERS
def test_outputs_and_voids_share_one_lane_in_arrival_order(run) -> None:
    async def main() -> None:
        inbox = Inbox()
        inbox.put(Void(4, 1, "injected"))
        inbox.put(Output(5, [1]))
        inbox.put(Hidden(6))
        assert inbox.pending(Output) == inbox.pending(Void) == 2
        assert [await inbox.terminal(), await inbox.terminal()] == [
            Void(4, 1, "injected"),
            Output(5, [1]),
        ]
        with pytest.raises(TypeError, match="one lane"):
            await inbox.get(Output)
        assert (await inbox.get(Hidden))[0] == Hidden(6)

    run(main())


def test_a_gloo_failure_reads_as_what_happened_in_one_line():
    from ringserve.ring.link import plain_reason

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:64691. This is typically caused by a remote worker "
        "crashing. Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6"
    )
    assert plain_reason(gloo) == "Connection closed by peer [127.0.0.1]:64691."
    assert plain_reason(RuntimeError("the peer sent a bad frame")) == "the peer sent a bad frame"
    assert plain_reason(RuntimeError("")) == "RuntimeError"
