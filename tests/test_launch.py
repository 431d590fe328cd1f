"""`ringserve launch` end to end: real rank processes, the real HTTP server,
the official `openai` client and ringserve's own async client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
import torch

from ringserve.client import AsyncClient
from ringserve.models.builtin import builtin_model_dir
from ringserve.plan.ledger import default_budgets
from tests.launched import Launched, free_port, pid_alive

pytestmark = pytest.mark.timeout(300)
COMMON = ("--wedge-timeout-s", "5", "--kv-capacity-tokens", "8192", "--max-model-len", "1024")


@pytest.fixture(scope="module", params=[1, 3], ids=["pp1", "pp3"])
def server(request):
    launched = Launched("--pp", str(request.param), *COMMON)
    yield launched
    gone = launched.stop(signal.SIGTERM)
    assert gone < 10, f"ranks took {gone:.1f} s to go after SIGTERM"
    assert launched.proc.returncode == 0, launched.output()


def two_node_ports() -> str:
    """A master port whose next port is free too (node 0's ring exchange)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return str(port)


def model_id(server: Launched) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    return client.models.list().data[0].id


def test_the_launcher_says_where_each_rank_runs_and_each_rank_agrees(server):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    places = [f"cuda:{r % count}" if count else "cpu" for r in range(len(server.ranks))]
    said = server.wait_for("devices: ", 10)
    assert said.endswith(", ".join(f"rank {r} {d}" for r, d in enumerate(places))), said
    for r, place in enumerate(places):
        assert server.wait_for(f"rank {r} loaded layers", 10).endswith(f"on {place}")


def test_openai_completions_stream_equals_plain(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = model_id(server)
    plain = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0
    )
    chunks = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12
    assert streamed == plain.choices[0].text and streamed


def test_openai_chat_stream_equals_plain(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = model_id(server)
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    plain = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == plain.choices[0].message.content
    assert plain.choices[0].message.role == "assistant"


async def test_async_client_and_concurrent_streams_hit_the_prefix_cache(server):
    system = "You are a careful assistant who answers in short sentences. " * 4
    async with AsyncClient(server.url) as client:
        assert (await client.health()).status == "ok"
        one = await client.complete(system + "Hello", max_tokens=6, temperature=0)
        assert one.finish_reason == "length" and len(one.token_ids) == 6

        async def stream(i: int) -> str:
            return "".join(
                [
                    d
                    async for d in client.stream(
                        system + f"Question {i}?", max_tokens=8, temperature=0
                    )
                ]
            )

        first = await asyncio.gather(*(stream(i) for i in range(64)))
        again = await asyncio.gather(*(stream(i) for i in range(64)))
    assert first == again and all(isinstance(t, str) for t in first)
    async with aiohttp.ClientSession() as session:
        async with session.get(server.url + "/metrics") as resp:
            metrics = await resp.text()
    hits = next(
        line for line in metrics.splitlines() if line.startswith("ringserve_cache_hit_tokens_total")
    )
    assert float(hits.split()[-1]) > 64 * 20, hits


async def test_bad_input_is_refused_and_the_server_carries_on(server):
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
            assert "error" in await resp.json()
        body = {"model": "nope", "prompt": "x", "max_tokens": 2}
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 404
        body = {"prompt": "x", "max_tokens": -3}
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 400
            assert "max_tokens" in (await resp.json())["error"]["message"]
        async with session.get(server.url + "/health") as resp:
            assert resp.status == 200
    async with AsyncClient(server.url) as client:
        done = await client.complete("still fine", max_tokens=3, temperature=0, ignore_eos=True)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3


def test_killed_rank_turns_health_red_and_ends_the_group():
    launched = Launched("--pp", "3", *COMMON)
    try:
        victim = launched.ranks[2]
        os.kill(victim, signal.SIGKILL)
        began = time.monotonic()
        while time.monotonic() - began < 5 + 5:
            try:
                status = _health_status(launched.url)
            except OSError:
                break
            if status != 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("/health stayed 200 after rank 2 was killed")
        launched.proc.wait(20)
        assert launched.proc.returncode != 0
        assert "rank 2 exited" in launched.output() and "SIGKILL" in launched.output()
    finally:
        launched.stop()
    assert not any(pid_alive(p) for p in launched.ranks.values())


def _health_status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("stop_node", [0, 1])
def test_two_launchers_act_as_two_nodes(stop_node):
    nodes = ("--pp", "2", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    first = Launched(*nodes, "--node-rank", "0", expect_ready=False)
    second = Launched(*nodes, "--node-rank", "1", expect_ready=False)
    try:
        first.wait_for("ready at", 180)
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none")
        out = client.completions.create(
            model=model_id(first), prompt="Two nodes", max_tokens=5, temperature=0
        )
        assert out.usage.completion_tokens == 5
        stopped, other = (first, second) if stop_node == 0 else (second, first)
        stopped.stop(signal.SIGTERM)
        other.proc.wait(30)
        if stop_node == 0:  # node 1's ranks ended with rank 0's orderly shutdown
            assert other.proc.returncode == 0, other.output()
            assert "rank 0 shut the ring down" in other.output()
        else:  # node 0 lost rank 1 with node 1: the cause is there
            assert "stopping: this node's ranks end once rank 0 shuts the ring down" in (
                stopped.output()
            ), stopped.output()
            said = other.wait_for("ending the group", 10)
            assert "its ring failed: a link to a neighbour ended" in said, said
            assert "likely on another node" in said, said
    finally:
        first.stop()
        second.stop()


def test_a_rank_killed_on_another_node_is_the_one_the_failed_request_names():
    """Rank 0 talks to ranks 1 and 3 alone: when rank 2 (node 1) dies, rank 3
    says so round to rank 0, and rank 1 waits for rank 0 to end the ring
    instead of leaving first, so the request fails naming rank 2, not the
    neighbour rank 0 would otherwise see go."""
    nodes = ("--pp", "4", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    slow = {"RINGSERVE_FAULTS": "slow:rank=3:ms=20"}
    first = Launched(*nodes, "--node-rank", "0", expect_ready=False, env=slow)
    second = Launched(*nodes, "--node-rank", "1", expect_ready=False, env=slow)
    try:
        first.wait_for("ready at", 180)
        answer: dict[str, object] = {}

        def ask() -> None:
            body = {"prompt": "Four ranks", "max_tokens": 900, "ignore_eos": True}
            req = urllib.request.Request(
                first.url + "/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    answer["status"], answer["body"] = resp.status, resp.read().decode()
            except urllib.error.HTTPError as exc:
                answer["status"], answer["body"] = exc.code, exc.read().decode()

        asking = threading.Thread(target=ask)
        asking.start()
        time.sleep(1.5)  # well into its 900 tokens, at 20 ms a pass
        os.kill(second.ranks[2], signal.SIGKILL)
        asking.join(60)
        assert answer.get("status") == 503, answer
        message = json.loads(answer["body"])["error"]["message"]
        assert "rank 2 is gone: " in message, message  # then gloo's words, which vary
        assert "GLHF" not in message and "pair.cc" not in message, message
        first.proc.wait(30)
        second.proc.wait(30)
    finally:
        first.stop()
        second.stop()


def test_a_second_node_with_the_same_node_rank_is_refused_and_the_ring_serves():
    nodes = ("--pp", "2", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    first = Launched(*nodes, "--node-rank", "0", expect_ready=False)
    twins = [Launched(*nodes, "--node-rank", "1", expect_ready=False) for _ in range(2)]
    try:
        first.wait_for("ready at", 180)
        began = time.monotonic()
        while all(t.proc.poll() is None for t in twins) and time.monotonic() - began < 30:
            time.sleep(0.1)
        refused = [t for t in twins if t.proc.poll() is not None]
        assert len(refused) == 1, [t.output() for t in twins]
        assert refused[0].proc.returncode == 2, refused[0].output()
        said = refused[0].wait_for("has already joined", 5)
        assert said.startswith("ringserve: node rank 1 has already joined"), said
        assert "started rank" not in refused[0].output()
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none")
        out = client.completions.create(
            model=model_id(first), prompt="Two nodes", max_tokens=3, temperature=0
        )
        assert out.usage.completion_tokens == 3
    finally:
        for node in (first, *twins):
            node.stop()


def test_a_node_whose_node_0_stops_before_the_ring_is_up_ends_within_seconds():
    """Node 0 stopped while its ranks still start: the other node's ranks,
    joining the rendezvous, would wait out its timeout (two minutes); its
    launcher sees node 0's exchange gone and ends them."""
    nodes = ("--pp", "2", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    second = Launched(*nodes, "--node-rank", "1", expect_ready=False)
    first = Launched(*nodes, "--node-rank", "0", expect_ready=False)
    try:
        first.wait_for("started rank 0", 120)
        second.wait_for("started rank 1", 30)
        first.proc.send_signal(signal.SIGINT)
        first.proc.wait(20)
        second.proc.wait(20)
        assert second.proc.returncode == 0, second.output()
        assert "node 0 is gone" in second.output(), second.output()
        assert "frame #" not in second.output(), second.output()
        assert not any(pid_alive(p) for p in second.ranks.values())
    finally:
        first.stop()
        second.stop()


def test_a_second_server_on_a_log_dir_in_use_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    from ringserve import LLM

    first = Launched("--log-dir", str(tmp_path), *COMMON)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "ringserve", "launch", "--log-dir", str(tmp_path), *COMMON],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert line == (
            f"ringserve: log dir {tmp_path} is in use by another server (node 0 of its ring "
            "logs there): give each server its own log directory"
        ), line
        with pytest.raises(ValueError, match="in use by another server"):
            LLM(log_dir=str(tmp_path))
    finally:
        first.stop()
    with LLM(log_dir=str(tmp_path), kv_capacity_tokens=4096) as llm:  # free again
        assert llm.generate(["x"], use_tqdm=False)[0].token_ids


def test_an_ipv6_host_is_served_at_a_url_that_names_it_in_brackets():
    launched = Launched("--host", "::1", *COMMON, expect_ready=False)
    try:
        said = launched.wait_for("ready at", 120)
        assert said == f"ringserve: ready at http://[::1]:{launched.port}", said
        url = said.split()[-1]
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert resp.status == 200
    finally:
        launched.stop()


def test_a_second_node_takes_the_ring_node_0_sized():
    """Each node was given its own split; the ring is node 0's, and node 1's
    rank loads node 0's layers for it."""
    nodes = ("--pp", "2", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    first = Launched(*nodes, "--layer-split", "1,3", "--node-rank", "0", expect_ready=False)
    second = Launched(*nodes, "--layer-split", "3,1", "--node-rank", "1", expect_ready=False)
    try:
        first.wait_for("ready at", 180)
        said = second.wait_for("ring sized by node 0", 10)
        assert said == "ringserve: ring sized by node 0: layer split 1,3, KV capacity 8192"
        said = second.wait_for("node 0's ring settings replace", 10)
        assert said.endswith("replace this node's: --layer-split 3,1 (node 0: 1,3)"), said
        assert second.wait_for("rank 1 loaded layers", 10).startswith(
            "ringserve: rank 1 loaded layers 1-3,"
        )
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none")
        out = client.completions.create(
            model=model_id(first), prompt="Two nodes", max_tokens=4, temperature=0
        )
        assert out.usage.completion_tokens == 4
    finally:
        first.stop()
        second.stop()


def test_without_budgets_each_node_measures_its_own_ranks_for_node_0s_plan():
    """One rank a node: node 0's plan holds each rank's budget as its own
    node measured it, a whole node's share (node 0 measuring both ranks on
    its own machine would have split its share between them)."""
    nodes = ("--pp", "2", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    first = Launched(*nodes, "--node-rank", "0", expect_ready=False)
    second = Launched(*nodes, "--node-rank", "1", expect_ready=False)
    try:
        first.wait_for("ready at", 180)
        rows = [line.split() for line in first.lines if re.match(r"\s+[01]\s+\d+-\d+ \(", line)]
        assert [(row[0], row[4]) for row in rows] == [("0", "measured"), ("1", "measured")]
        share = default_budgets(1)[0].bytes / 2**20  # one rank alone on this machine
        for row in rows:
            assert float(row[3]) == pytest.approx(share, rel=0.15), (row, share)
        second.wait_for("ring sized by node 0", 10)
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("sizing", [(), ("--layer-split", "2,2")], ids=["measured", "split"])
def test_a_node_started_for_another_ring_is_refused_by_both_nodes(sizing):
    """Node 0 sized a ring of 2 ranks on 2 nodes; a node started for 4 on 4
    says so and ends, and node 0, told, ends too: neither waits for ranks
    that will never meet (whether node 0 waited for its budgets or not)."""
    port = two_node_ports()
    first = Launched("--pp", "2", "--nnodes", "2", "--master-port", port, *COMMON, *sizing,
                     "--node-rank", "0", expect_ready=False)  # fmt: skip
    second = Launched("--pp", "4", "--nnodes", "4", "--master-port", port, *COMMON,
                      "--node-rank", "1", expect_ready=False)  # fmt: skip
    try:
        for node in (first, second):
            assert node.proc.wait(60) == 2, node.output()
        why = "node 1 was started with --pp 4 --nnodes 4, node 0 with --pp 2 --nnodes 2"
        assert (
            second.wait_for("start every node", 10)
            == f"ringserve: {why}: start every node with the same ring"
        )
        assert first.wait_for("refused", 10) == f"ringserve: node 1 refused the ring: {why}"
        assert "started rank" not in first.output() + second.output()
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_node_alone_says_what_it_waits_for_and_ctrl_c_ends_it(node_rank):
    """Waiting for the other node (node 0 for node 1's budgets, node 1 for
    node 0's exchange) says so, and Ctrl-C ends the wait at once."""
    nodes = ("--pp", "2", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    alone = Launched(*nodes, "--node-rank", str(node_rank), expect_ready=False)
    try:
        alone.wait_for("waiting for", 30)
        alone.proc.send_signal(signal.SIGINT)
        assert alone.proc.wait(5) == 130, alone.output()
    finally:
        alone.stop()


def test_nodes_serving_different_models_refuse_to_start_and_say_why(tmp_path):
    """What node 0 cannot hand over, the model itself, must match: ranks
    whose model's config differs from rank 0's refuse, one line each, and
    both launchers end."""
    other = tmp_path / "other"
    shutil.copytree(builtin_model_dir(), other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-5) * 2
    (other / "config.json").write_text(json.dumps(config))
    nodes = ("--pp", "2", "--nnodes", "2", "--master-port", two_node_ports(), *COMMON)
    first = Launched(*nodes, "--node-rank", "0", expect_ready=False)
    second = Launched(*nodes, "--model", str(other), "--node-rank", "1", expect_ready=False)
    try:
        for node in (first, second):
            node.proc.wait(120)
            assert node.proc.returncode != 0
            said = node.wait_for("were started with ring settings other than rank 0's", 10)
            assert said.startswith(f"ringserve: rank {node is second:d}: ranks [1]"), said
            assert "config.json rms_norm_eps" in said, said  # what differs, named
        assert "ready at" not in first.output()
    finally:
        first.stop()
        second.stop()


def test_sigterm_ends_a_long_stream_with_its_reason_and_the_group_promptly():
    """A request still generating when the server is stopped cannot finish
    (the conductor stops with it): it ends with the reason at once, and the
    ranks are gone in seconds, not after the HTTP server's grace period."""
    import threading

    slow = {"RINGSERVE_FAULTS": "slow:rank=1:ms=50"}
    launched = Launched("--pp", "2", *COMMON, env=slow)
    client = openai.OpenAI(base_url=launched.url + "/v1", api_key="none", max_retries=0)
    first, ended = threading.Event(), threading.Event()
    seen: list[str] = []

    def read() -> None:
        try:
            stream = client.completions.create(
                model=model_id(launched), prompt="hi", max_tokens=900, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                seen.append(chunk.choices[0].text if chunk.choices else "")
                first.set()
        except Exception as exc:  # the server says why the stream ends
            seen.append(f"error: {exc}")
        finally:
            first.set()
            ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(60), launched.output()
    gone = launched.stop(signal.SIGTERM)
    assert ended.wait(10), "the stream was left open"
    assert gone < 10, f"ranks took {gone:.1f} s to go after SIGTERM"
    assert len(seen) < 900, "the request finished instead of being ended"
    assert any("shutting down" in s for s in seen), seen[-3:]
