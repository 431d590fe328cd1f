"""A bounded queue: beyond `max_waiting_requests` waiting requests a new one
is refused with 429 and Retry-After (the openai client's RateLimitError),
and one still waiting after `queue_timeout_s` fails with the reason; both
counted in /metrics, neither disturbing what runs, and a timed-out run
still replays."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from ringserve import LLM, SamplingParams
from ringserve.cli import _config, parser
from ringserve.config import EngineConfig
from ringserve.models.builtin import builtin_model_dir
from ringserve.replay import replay
from tests.test_http import GREEDY, PROMPT, Server, serving

LONG = {"prompt": PROMPT, "max_tokens": 480, "stream": True, **GREEDY}  # outlasts each test
SHORT = {"prompt": PROMPT, "max_tokens": 2, **GREEDY}


@contextlib.asynccontextmanager
async def running_one(server: Server) -> AsyncIterator[aiohttp.ClientResponse]:
    """A long streamed request that has begun generating: with max_batch 1
    it holds the only place in a pass, so every later request waits."""
    async with aiohttp.ClientSession() as raw:
        resp = await raw.post(server.url + "/v1/completions", json=LONG)
        assert resp.status == 200
        assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
        yield resp
        resp.close()


async def waiting(server: Server, n: int) -> None:
    async with asyncio.timeout(5):
        while len(server.conductor.scheduler.waiting) != n:
            await asyncio.sleep(0.005)


def metric(text: str, name: str) -> float:
    [line] = [x for x in text.splitlines() if x.startswith(f"ringserve_{name} ")]
    return float(line.split()[1])


@pytest.mark.timeout(60)
async def test_a_request_beyond_the_waiting_bound_gets_429_and_the_server_carries_on() -> None:
    async with serving(max_batch=1, max_waiting_requests=1) as server:
        async with running_one(server):
            queued = asyncio.create_task(server.post("/v1/completions", SHORT))
            await waiting(server, 1)
            async with server.session.post(server.url + "/v1/completions", json=SHORT) as resp:
                assert resp.status == 429
                assert resp.headers["Retry-After"] == "1"
                error = (await resp.json())["error"]
            assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
            assert "1 requests are waiting for admission" in error["message"]
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(model="ringserve-builtin", prompt=PROMPT)
            assert refused.value.response.headers["retry-after"] == "1"
            await client.close()
            # the refused left no trace; the queued one is still waiting
            assert server.conductor.metrics.requests_total == 2
            assert len(server.conductor.scheduler.waiting) == 1 and not queued.done()
        status, body = await queued  # the long one gone, the queued one is served
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 2
        _, text = await server.get("/metrics")
        assert metric(text, "requests_rejected_total") == 2
        assert metric(text, "requests_timed_out_total") == 0
        await server.assert_serving()
        await server.assert_no_kv_held()


@pytest.mark.timeout(60)
async def test_a_request_with_more_choices_than_the_queue_holds_is_a_400_not_a_429() -> None:
    """Retrying could never help it, so it is not told to retry."""
    async with serving(max_waiting_requests=2) as server:
        status, body = await server.post("/v1/completions", {**SHORT, "n": 3})
        assert status == 400 and body["error"]["param"] == "n"
        assert "queues at most 2" in body["error"]["message"]
        status, body = await server.post("/v1/completions", {**SHORT, "n": 2})
        assert status == 200 and len(body["choices"]) == 2
        await server.assert_no_kv_held()


@pytest.mark.timeout(60)
async def test_a_request_waiting_past_the_queue_timeout_fails_with_the_reason() -> None:
    async with serving(max_batch=1, queue_timeout_s=0.3) as server:
        async with running_one(server):
            [runner] = server.conductor.handles.values()
            status, body = await server.post("/v1/completions", SHORT)
            assert status == 503, body
            error = body["error"]
            assert error["code"] == "queue_timeout"
            assert "queue timeout: still waiting for admission after 0.3 s" in error["message"]
            assert not server.conductor.scheduler.waiting  # nothing of it is left
            assert not runner.done  # the running one is never dropped
            await asyncio.sleep(0.4)  # past its own timeout: it runs on
            assert not runner.done and len(runner.req.output) > 1
        _, text = await server.get("/metrics")
        assert metric(text, "requests_timed_out_total") == 1
        assert metric(text, "requests_rejected_total") == 0
        await server.assert_serving()
        await server.assert_no_kv_held()


@pytest.mark.timeout(120)
def test_a_run_with_queue_timeouts_replays_with_the_scheduler_rerun(tmp_path) -> None:
    """The time-based drop is an abort in the log, an input of the re-run."""
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with LLM(log_dir=str(tmp_path), max_batch=1, queue_timeout_s=0.2) as llm:
        outs = llm.generate([[5, 6, 7], [8, 9], [10, 11]], [long, short, short])
    assert outs[0].finish_reason == "length"
    assert all(o.finish_reason.startswith("error: queue timeout") for o in outs[1:]), outs
    report = replay(tmp_path)
    assert report.consistent, report.render()
    assert report.rerun.reproduced and report.rerun.aborts == 2


@pytest.mark.timeout(120)
def test_the_offline_api_waits_for_room_instead_of_being_refused() -> None:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with LLM(max_batch=1, max_waiting_requests=1) as llm:
        outs = llm.generate([[5, 6, i] for i in range(6)], params)
        assert llm._ring is not None and llm._ring.conductor.metrics.requests_rejected > 0
    assert [len(o.token_ids) for o in outs] == [3] * 6


def test_the_queue_options_are_validated_and_passed_on_by_the_cli() -> None:
    model = builtin_model_dir()
    assert EngineConfig(model_dir=model, kv_capacity_tokens=4096).waiting_limit == 256
    assert EngineConfig(model_dir=model, max_waiting_requests=3).waiting_limit == 3
    for bad in ({"max_waiting_requests": 0}, {"queue_timeout_s": 0}, {"queue_timeout_s": -1.0}):
        with pytest.raises(ValueError):
            EngineConfig(model_dir=model, **bad)
    args = parser().parse_args(
        ["launch", "--max-waiting-requests", "7", "--queue-timeout-s", "2.5"]
    )
    config = _config(args)
    assert config.max_waiting_requests == 7 and config.queue_timeout_s == 2.5
    default = _config(parser().parse_args(["launch"]))
    assert default.max_waiting_requests is None and default.queue_timeout_s is None


@pytest.mark.timeout(60)
async def test_a_retracted_request_back_in_the_queue_does_not_count_against_its_bound() -> None:
    """Two requests outgrow the pool: one is retracted into the queue, work
    already taken on; a new request is still let in under a bound of one."""
    long = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    async with serving(max_batch=2, max_waiting_requests=1, kv_capacity_tokens=640) as server:
        scheduler = server.conductor.scheduler
        both = []
        for running in (1, 2):  # one at a time: the bound of one holds each at its turn
            both.append(asyncio.create_task(server.post("/v1/completions", long)))
            async with asyncio.timeout(10):
                while len(scheduler.running) < running:
                    await asyncio.sleep(0.002)
        async with asyncio.timeout(30):
            while not any(r.admitted for r in scheduler.waiting):
                await asyncio.sleep(0.002)
        status, body = await server.post("/v1/completions", SHORT)
        assert status == 200, body
        assert [s for s, _ in await asyncio.gather(*both)] == [200, 200]
