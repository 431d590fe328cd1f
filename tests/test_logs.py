"""Logging of a rank: JSON lines per rank with rank and monotonic time, the
console gate, the level gate that spares per-pass work when nothing keeps
debug events, the offline LLM's scope that restores what it found, and
lines that reach the file within a fraction of a second (a rank killed by
SIGKILL keeps its events)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import structlog

from ringserve import logs
from ringserve.engine.stage import Stage
from ringserve.ring.messages import Decision, Entry, NewRequest, SamplingSpec
from tests.launched import Launched

log = structlog.get_logger("tests.logs")


@pytest.fixture(autouse=True)
def _restore_structlog():
    saved = structlog.get_config()
    yield
    logs.flush()
    structlog.configure(**saved)


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def decision(p: int) -> Decision:
    entry = Entry(req_id=7, start=0, tokens=[5, 6], slots=[1, 2], sample=True, reuse=[])
    return Decision(p, 0, [NewRequest(7, SamplingSpec(seed=3))], [entry], [])


def test_file_gets_every_level_with_rank_and_monotonic_time(tmp_path, capsys):
    path = logs.configure(2, tmp_path, console_level="warning")
    log.debug("probe.debug", pass_id=4)
    log.warning("probe.warning", pass_id=5)
    logs.flush()
    events = [e for e in read(path) if e["event"].startswith("probe.")]
    assert path.name == "rank2.jsonl"
    assert [(e["event"], e["rank"], e["pass_id"], e["level"]) for e in events] == [
        ("probe.debug", 2, 4, "debug"),
        ("probe.warning", 2, 5, "warning"),
    ]
    assert events[0]["t"] <= events[1]["t"]
    console = capsys.readouterr().err
    assert "probe.warning" in console and "probe.debug" not in console


def test_a_logged_exception_keeps_its_traceback_in_the_file_and_on_the_console(tmp_path, capsys):
    path = logs.configure(0, tmp_path, console_level="error")
    try:
        raise ValueError("the body was not gzip")
    except ValueError:
        log.exception("probe.error", path="/v1/completions")
    logs.flush()
    (event,) = [e for e in read(path) if e["event"] == "probe.error"]
    assert "ValueError: the body was not gzip" in event["exception"]
    assert "Traceback" in event["exception"] and "exc_info" not in event
    assert "ValueError: the body was not gzip" in capsys.readouterr().err


def test_a_new_opening_marks_the_start_of_a_run(tmp_path):
    path = logs.configure(0, tmp_path)
    logs.configure(0, tmp_path)
    logs.flush()
    assert [e["event"] for e in read(path)].count("log.opened") == 2


def test_tracing_is_off_without_a_file_at_a_quiet_console(tmp_path):
    logs.configure(1, None, console_level="warning")
    assert not logs.tracing()
    logs.configure(1, tmp_path, console_level="warning")
    assert logs.tracing()


def test_stage_built_while_not_tracing_never_computes_a_digest(monkeypatch, tmp_path):
    def refuse(self: Decision) -> str:
        raise AssertionError("digest computed for a filtered event")

    logs.configure(1, None, console_level="warning")
    quiet = Stage(runner=None, rank=1)  # apply never touches the runner
    monkeypatch.setattr(Decision, "digest", refuse)
    quiet.apply(decision(0))
    monkeypatch.undo()
    path = logs.configure(1, tmp_path, console_level="warning")
    traced = Stage(runner=None, rank=1)
    traced.apply(decision(0))
    logs.flush()
    applied = [e for e in read(path) if e["event"] == "decision.applied"]
    assert [(e["pass_id"], e["digest"]) for e in applied] == [(0, decision(0).digest())]


def test_scope_restores_the_config_and_closes_its_file(tmp_path):
    before = structlog.get_config()["processors"]
    scope = logs.LogScope(0, tmp_path)
    log.info("probe.inside")
    scope.close()
    log.info("probe.after")
    scope.close()  # idempotent
    assert structlog.get_config()["processors"] == before
    events = [e["event"] for e in read(tmp_path / "rank0.jsonl")]
    assert "probe.inside" in events and "probe.after" not in events


def test_closing_an_older_scope_keeps_a_newer_one_in_place(tmp_path):
    outer = logs.LogScope(0, tmp_path / "a")
    inner = logs.LogScope(0, tmp_path / "b")
    outer.close()
    log.info("probe.inner")
    inner.close()
    assert "probe.inner" in [e["event"] for e in read(tmp_path / "b" / "rank0.jsonl")]


def test_silenced_drops_events_and_restores(tmp_path):
    path = logs.configure(0, tmp_path)
    with logs.silenced():
        log.info("probe.silenced")
    log.info("probe.loud")
    logs.flush()
    events = [e["event"] for e in read(path)]
    assert "probe.loud" in events and "probe.silenced" not in events


@pytest.mark.timeout(180)
def test_a_rank_killed_by_sigkill_leaves_its_events_up_to_the_kill(tmp_path):
    """A launched pp 3 ring serves a request, rests 0.5 s, and rank 1 is
    killed with SIGKILL: its file holds every pass it applied and every
    message rank 2 received from it more than 0.1 s before the kill."""
    args = ("--pp", "3", "--log-dir", str(tmp_path), "--kv-capacity-tokens", "512")
    with Launched(*args, "--max-model-len", "512") as server:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            server.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        assert (
            json.loads(urllib.request.urlopen(request, timeout=60).read())["usage"][
                "completion_tokens"
            ]
            == 30
        )
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(server.ranks[1], signal.SIGKILL)
        server.proc.wait(30)
    rank0, rank1, rank2 = (read(tmp_path / f"rank{r}.jsonl") for r in range(3))
    made = [e["pass_id"] for e in rank0 if e["event"] == "decision.made"]
    applied = [e["pass_id"] for e in rank1 if e["event"] == "decision.applied"]
    assert len(made) >= 30 and applied == made

    def key(e: dict) -> tuple:
        return e["kind"], e.get("pass_id"), e.get("seq")

    sent = {key(e) for e in rank1 if e["event"] == "msg.sent"}
    owed = [
        key(e)
        for e in rank2
        if e["event"] == "msg.received" and e["peer"] == 1 and e["t"] < killed_at - 0.1
    ]
    assert owed and [k for k in owed if k not in sent] == []


UNREAD_STDERR = """
import os, sys, time
from ringserve import logs
import structlog
logs.configure(1, sys.argv[1], console_level="warning", final=True)
log = structlog.get_logger("probe")
for i in range(20000):
    log.warning("probe.unread", i=i, pad="x" * 100)
logs.flush()
print("done", flush=True)
os._exit(0)
"""


@pytest.mark.timeout(60)
def test_a_rank_whose_stderr_nobody_reads_keeps_going_and_its_file_keeps_everything(tmp_path):
    """20000 console warnings are far more than a pipe holds: the logging
    thread must never block on stderr (it would wedge the rank's loop)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", UNREAD_STDERR, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out = proc.stdout.readline()  # stderr is never read while it runs
        assert out.strip() == "done"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [e for e in read(tmp_path / "rank1.jsonl") if e["event"] == "probe.unread"]
    assert [e["i"] for e in events] == list(range(20000))
    assert "probe.unread" in proc.stderr.read()


def test_a_log_on_a_full_disk_stops_there_said_once_and_the_rank_goes_on(capsys):
    sink = logs._Sink(Path("/dev/full"))  # every write: no space left on device
    sink.add(b'{"event": "a"}\n')
    sink.flush()
    sink.add(b'{"event": "b"}\n')  # dropped: the log has ended
    sink.flush()
    sink.close()
    said = capsys.readouterr().err.splitlines()
    assert said == ["ringserve: the log /dev/full stops here: No space left on device"], said
    assert sink.pending == []
