"""`ringserve replay` over the logs of real rings (pp 3, real rank
processes): a consistent run replays clean, scheduler re-run included; a
wedged run is named with its wait-for chain; tampered logs are reported for
what they are."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ringserve import LLM, SamplingParams
from ringserve.client import AsyncClient
from ringserve.replay import Wait, main, replay
from tests.launched import Launched
from tests.test_bench import metrics

RING = dict(
    pp_size=3,
    layer_split=[2, 1, 1],
    chunk_size=16,
    max_tokens_per_pass=48,
    max_batch=3,
    # small enough that the relief ladder runs: evictions, retractions, parking
    kv_capacity_tokens=128,
)
SHARED = list(range(40, 70))
PROMPTS = [SHARED + [100 + i] * (i + 1) for i in range(4)] + [[7, 8, 9], list(range(200, 230))]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.7, min_p=0.1),
    SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[5], ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
]
TAMPERED_PASS = 5


def close_and_check(llm: LLM) -> None:
    procs = list(llm._ring.children.procs.values()) if llm._ring is not None else []
    llm.close()
    assert procs and all(p.poll() is not None for p in procs), "a rank process outlived its LLM"


async def abort_one_midway(conductor) -> list[str | None]:
    """Two requests; the first is aborted after three tokens (a client gone)."""
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    handles = [conductor.submit(p, long) for p in PROMPTS[:2]]
    while len(handles[0].req.output) < 3:
        await asyncio.sleep(0.005)
    conductor.abort(handles[0].req_id)
    return [(await h.result()).finish_reason for h in handles]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    """A consistent pp 3 run with concurrent requests, prefix reuse,
    evictions, retractions, parking and an abort."""
    log_dir = tmp_path_factory.mktemp("clean")
    llm = LLM(log_dir=str(log_dir), **RING)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        assert all(o.finish_reason == "length" for o in outs)
        ring = llm._ring
        finished = asyncio.run_coroutine_threadsafe(abort_one_midway(ring.conductor), ring.loop)
        assert finished.result(timeout=60) == ["abort", "length"]
    finally:
        close_and_check(llm)
    return log_dir


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rewrite(path: Path, change) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in change(events(path))))


def is_msg(e: dict, event: str, kind: str, p: int) -> bool:
    return e["event"] == event and e.get("kind") == kind and e.get("pass_id") == p


@pytest.fixture
def copied(clean_run, tmp_path) -> Path:
    return Path(shutil.copytree(clean_run, tmp_path / "run"))


@pytest.mark.timeout(120)
def test_a_run_logged_on_two_nodes_replays_from_both_directories(clean_run, tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for node, ranks in ((node0, (0, 1)), (node1, (2,))):
        node.mkdir()
        for r in ranks:
            shutil.copy(clean_run / f"rank{r}.jsonl", node)
    report = replay(node0, node1)
    assert report.consistent, report.render()
    assert report.world == 3 and report.log_dir == f"{node0}, {node1}"
    alone = replay(node0)
    (missing,) = [f for f in alone.findings if f.kind == "log.missing"]
    assert missing.message.endswith("(on several nodes: give every node's log directory)")
    assert alone.render().splitlines()[1].startswith("  logs       rank 2 has no log in")
    shutil.copy(clean_run / "rank2.jsonl", node0)
    with pytest.raises(ValueError, match="rank 2 has a log in .* and in "):
        replay(node0, node1)
    result = subprocess.run(
        [sys.executable, "-m", "ringserve", "replay", str(node1), str(clean_run)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "rank 2 has a log in" in result.stderr, result.stderr


@pytest.mark.timeout(120)
def test_a_clean_run_replays_consistent_with_the_scheduler_rerun(clean_run):
    report = replay(clean_run)
    assert report.consistent, report.render()
    assert report.world == 3 and report.wedge is None
    assert report.requests == len(PROMPTS) + 2
    assert report.rerun.reproduced and report.rerun.decisions == report.passes
    assert report.rerun.aborts >= 1 and report.rerun.empty_schedules > 0
    rank0 = [e["event"] for e in events(clean_run / "rank0.jsonl")]
    assert {"request.retracted", "request.parked", "request.abort"} <= set(rank0)
    assert any(
        e["event"] == "cache.evict" and e["freed"] > 0 for e in events(clean_run / "rank0.jsonl")
    )


@pytest.mark.timeout(60)
def test_the_command_exits_0_and_prints_json_for_a_clean_run(clean_run):
    cmd = [sys.executable, "-m", "ringserve", "replay", str(clean_run), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["consistent"] is True and doc["findings"] == []
    assert doc["rerun"]["reproduced"] is True


@pytest.mark.timeout(180)
def test_a_launched_server_logs_every_rank_and_replays_consistent(tmp_path):
    """Rank 0 as the serving process (`ringserve launch --log-dir`)."""
    args = ("--pp", "3", "--log-dir", str(tmp_path), "--max-batch", "2", "--chunk-size", "16")
    with Launched(*args, "--kv-capacity-tokens", "512", "--max-model-len", "512") as server:
        asyncio.run(_complete_concurrently(server.url))
    assert server.proc.returncode == 0, server.output()
    report = replay(tmp_path)
    assert report.consistent, report.render()
    assert report.requests == 4 and report.rerun.reproduced


async def _complete_concurrently(url: str) -> None:
    async with AsyncClient(url) as client:
        done = await asyncio.gather(
            *(
                client.complete(
                    f"Question {i}?", max_tokens=6 + i, temperature=0.5, ignore_eos=True
                )
                for i in range(4)
            )
        )
    assert [len(c.token_ids) for c in done] == [6, 7, 8, 9]


@pytest.mark.timeout(120)
def test_a_wedged_run_is_named_with_its_wait_for_chain(tmp_path, monkeypatch, capsys):
    # Voided passes (7, 15) before the drop: their terminals are re-run too.
    monkeypatch.setenv("RINGSERVE_FAULTS", "void:rank=1:every=8,drop:rank=1:kind=hidden:pass=20")
    llm = LLM(log_dir=str(tmp_path), wedge_timeout_s=2.0, **RING)
    try:
        ring = llm._ring
        conductor = ring.conductor
        # One request: one pass in flight at a time, so the drop wedges the ring.
        one = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        asyncio.run_coroutine_threadsafe(_submit(conductor, [5, 9, 17], one), ring.loop).result(10)
        launched = _wait_until(lambda: conductor.scheduler.next_pass_id > 20, 30)
        turned = _wait_until(lambda: not conductor.health.healthy, 10)
        assert turned - launched <= 2.0 + 1.5, "health stayed green past the wedge timeout"
        assert "pass 20" in conductor.health.reason
    finally:
        close_and_check(llm)
    code = main(argparse.Namespace(log_dirs=[str(tmp_path)], json=False))
    out = capsys.readouterr().out
    assert code == 1
    assert "pass 20 has no terminal" in out
    assert "rank 0 waits output of pass 20 from rank 2" in out
    assert "rank 2 waits hidden of pass 20 from rank 1" in out
    assert "rank 1 received decision and hidden of pass 20" in out and "fault.drop" in out
    report = replay(tmp_path)
    assert report.wedge.waits == [Wait(0, "output", 20, 2), Wait(2, "hidden", 20, 1)]
    assert report.last_completed == {0: 19, 1: 19, 2: 19}
    assert report.kinds() == {"terminal.missing"} and report.rerun.reproduced
    voids = [e for e in events(tmp_path / "rank0.jsonl") if e["event"] == "pass.void"]
    assert [e["pass_id"] for e in voids] == [7, 15]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dropper", [0, 1])
def test_a_hidden_lost_with_passes_behind_it_fails_the_ring_with_its_reason(
    tmp_path, monkeypatch, dropper
):
    """With several passes in flight, the pass after a dropped Hidden
    reaches the next rank first: that rank sends the reason on round to
    rank 0 (through rank 2 when rank 1 finds it), which fails the requests
    with it (not with the ends of the links it causes); the finder, the
    ranks it passed by and rank 0 log it, rank 0's SHUTDOWN still goes
    round (no link fails), and replay names it."""
    monkeypatch.setenv("RINGSERVE_FAULTS", f"drop:rank={dropper}:kind=hidden:pass=20")
    llm = LLM(log_dir=str(tmp_path), wedge_timeout_s=60.0, **RING)
    finder = dropper + 1
    lost = rf"rank {finder} got hidden of pass \d+, owed 20: the hidden of pass 20 was lost"
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        with pytest.raises(RuntimeError, match=lost):
            llm.generate([[5, 9, 17 + i] for i in range(6)], params, use_tqdm=False)
    finally:
        close_and_check(llm)
    logged = {r: events(tmp_path / f"rank{r}.jsonl") for r in range(3)}
    failed = {r: [e["reason"] for e in logged[r] if e["event"] == "ring.failed"] for r in range(3)}
    for rank in (0, *range(finder, 3)):
        assert [re.fullmatch(lost, reason) is not None for reason in failed[rank]] == [True], failed
    assert not [e for r in range(3) for e in logged[r] if e["event"] == "link.failed"]
    report = replay(tmp_path)
    said = f"rank {finder}: rank {finder} got hidden"
    assert any(f.startswith(said) for f in report.failures), report.failures
    assert "cut off by the ring's failure at pass 20" in report.render()


@pytest.mark.timeout(180)
def test_a_launched_wedge_stopped_by_sigterm_replays_with_its_true_chain(tmp_path):
    """The wedge above, served by `ringserve launch` and ended by SIGTERM:
    every rank's log holds its events, so the chain ends at rank 1's drop."""
    args = ("--pp", "3", "--log-dir", str(tmp_path), "--wedge-timeout-s", "2")
    env = {"RINGSERVE_FAULTS": "drop:rank=1:kind=hidden:pass=20"}
    with Launched(
        *args, "--kv-capacity-tokens", "512", "--max-model-len", "512", env=env
    ) as server:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
        }
        threading.Thread(target=_post_quietly, args=(server.url, body), daemon=True).start()
        _wait_until(lambda: _health_status(server.url) == 503, 60)
        server.stop(signal.SIGTERM)
    report = replay(tmp_path)
    rendered = report.render()
    assert report.wedge is not None and report.wedge.pass_id == 20, rendered
    assert report.wedge.waits == [Wait(0, "output", 20, 2), Wait(2, "hidden", 20, 1)], rendered
    assert "rank 2 waits hidden of pass 20 from rank 1" in rendered
    assert "rank 1 received decision and hidden of pass 20" in rendered
    assert "fault.drop" in rendered
    # rank 1's log is whole to its end, however the group ended: in order
    # (rank 0 ended its requests and sent SHUTDOWN round, which passes the
    # dropped Hidden), or stopped by the launcher (rank 1 flushed on SIGTERM)
    rank1 = [e["event"] for e in events(tmp_path / "rank1.jsonl")]
    in_order = "ring.shutdown" in rank1
    stopped = rank1[-1] == "rank.terminated" and "stopping every rank" in server.output()
    assert in_order or stopped, (rank1[-5:], server.output()[-500:])


@pytest.mark.timeout(180)
def test_a_launched_ring_stopped_by_sigterm_under_load_replays_consistent(tmp_path):
    """A signal lands while passes are in flight: rank 0 launches no more
    and lets those end before SHUTDOWN goes round, so every pass has its
    terminal and nothing looks wedged (rank 1 used to take SHUTDOWN while
    still computing a pass, whose terminal never came)."""
    with Launched("--pp", "2", "--log-dir", str(tmp_path)) as server:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        for _ in range(8):
            threading.Thread(target=_post_quietly, args=(server.url, body), daemon=True).start()
        _wait_until(lambda: metrics(server.url)["ringserve_generation_tokens_total"] > 200, 60)
        server.stop(signal.SIGTERM)
        assert server.proc.returncode == 0, server.output()[-500:]
    report = replay(tmp_path)
    assert report.kinds() == set() and report.wedge is None, report.render()
    assert report.rerun.reproduced and report.rerun.aborts == 8


def _post_quietly(url: str, body: dict) -> None:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        urllib.request.urlopen(request, timeout=120).read()
    except OSError:
        pass  # the server goes away mid-request: that is the drill


def _health_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


async def _submit(conductor, prompt, params) -> None:
    conductor.submit(prompt, params)


def _wait_until(condition, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic()


def test_a_digest_changed_on_one_rank_is_a_digest_mismatch(copied):
    def change(evs):
        for e in evs:
            if e["event"] == "decision.applied" and e["pass_id"] == TAMPERED_PASS:
                e["digest"] = "0" * 16
        return evs

    rewrite(copied / "rank1.jsonl", change)
    report = replay(copied)
    assert report.kinds() == {"decision.digest_mismatch"}
    [finding] = report.findings
    assert (finding.rank, finding.pass_id) == (1, TAMPERED_PASS)


def test_a_missing_receive_is_an_unmatched_send(copied):
    drop = lambda evs: [e for e in evs if not is_msg(e, "msg.received", "hidden", TAMPERED_PASS)]  # noqa: E731
    rewrite(copied / "rank2.jsonl", drop)
    report = replay(copied)
    assert report.kinds() == {"message.unmatched_send"}
    [finding] = report.findings
    assert (finding.rank, finding.pass_id) == (1, TAMPERED_PASS)
    assert "hidden of pass 5 to rank 2" in finding.message


def test_a_pass_with_two_terminals_is_reported_as_such(copied):
    def twice(event: str):
        def change(evs):
            at = next(i for i, e in enumerate(evs) if is_msg(e, event, "output", TAMPERED_PASS))
            return evs[: at + 1] + [dict(evs[at])] + evs[at + 1 :]

        return change

    rewrite(copied / "rank2.jsonl", twice("msg.sent"))
    rewrite(copied / "rank0.jsonl", twice("msg.received"))
    report = replay(copied)
    assert report.kinds() == {"terminal.extra"}
    assert report.findings[0].pass_id == TAMPERED_PASS
    assert "2 terminals" in report.render()


def test_a_recorded_decision_that_does_not_match_its_digest_is_reported(copied):
    def change(evs):
        made = next(e for e in evs if is_msg(e, "decision.made", None, TAMPERED_PASS))
        made["decision"]["entries"][0]["slots"][0] += 1
        return evs

    rewrite(copied / "rank0.jsonl", change)
    report = replay(copied)
    assert report.kinds() == {"decision.content_mismatch"}
    assert report.findings[0].pass_id == TAMPERED_PASS


def test_passes_applied_out_of_order_are_reported(copied):
    def swap(evs):
        at = [i for i, e in enumerate(evs) if e["event"] == "decision.applied"][3:5]
        evs[at[0]], evs[at[1]] = evs[at[1]], evs[at[0]]
        return evs

    rewrite(copied / "rank2.jsonl", swap)
    report = replay(copied)
    assert report.kinds() == {"decision.out_of_order"}


def test_the_scheduler_rerun_detects_a_changed_arrival(copied):
    def change(evs):
        arrival = next(e for e in evs if e["event"] == "request.arrival")
        arrival["prompt"] = [t + 1 for t in arrival["prompt"]]
        return evs

    rewrite(copied / "rank0.jsonl", change)
    report = replay(copied)
    assert report.kinds() == {"rerun.differs"}
    assert not report.rerun.reproduced
    [finding] = report.findings
    assert finding.pass_id == 0 and "first difference at decision." in finding.message


def test_a_reused_log_dir_is_read_as_its_last_run(copied):
    for path in copied.glob("rank*.jsonl"):
        path.write_text(path.read_text() * 2)  # the same run logged twice into one dir
    report = replay(copied)
    assert report.consistent, report.render()
    assert any("holds 2 runs" in note for note in report.notes)


def test_a_dir_without_logs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no rank"):
        replay(tmp_path)


@pytest.mark.timeout(60)
def test_every_decision_travels_in_the_frame_of_its_passs_hidden(clean_run):
    """Rank 0 and the middle rank send a pass as one frame: the Decision
    rides ahead of the pass's Hidden (logged with no bytes of its own, right
    before it), so a pass costs each link one head, not two."""
    for rank in (0, 1):
        sent = [e for e in events(clean_run / f"rank{rank}.jsonl") if e["event"] == "msg.sent"]
        decisions = [i for i, e in enumerate(sent) if e["kind"] == "decision"]
        assert len(decisions) > 20
        for i in decisions:
            p = sent[i]["pass_id"]
            assert sent[i]["bytes"] == 0, sent[i]
            rest = sent[i + 1 :]
            frame = next(e for e in rest if e["bytes"] > 0)  # the frame it rode in
            assert (frame["kind"], frame["pass_id"]) == ("hidden", p), (sent[i], frame)
