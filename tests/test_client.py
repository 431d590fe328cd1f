"""The async client against a real server (the same harness as the HTTP
tests: a loopback port over a single-rank conductor on the built-in model)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest

from ringserve.client import (
    ApiError,
    AsyncClient,
    ChatCompletion,
    Completion,
    ConnectionFailed,
    Generation,
)
from tests.test_http import GREEDY, MESSAGES, MODEL, PROMPT, Server, serving


@pytest.fixture
async def served() -> AsyncIterator[tuple[Server, AsyncClient]]:
    async with serving() as server, AsyncClient(server.url, timeout_s=30) as client:
        yield server, client


@pytest.mark.timeout(30)
async def test_complete_returns_a_typed_completion(served: tuple[Server, AsyncClient]) -> None:
    server, client = served
    done = await client.complete(PROMPT, max_tokens=5, **GREEDY)
    assert isinstance(done, Completion)
    assert done.finish_reason == "length" and len(done.token_ids) == 5
    assert done.text == server.conductor.tokenizer.decode(done.token_ids)
    assert done.usage.completion_tokens == 5
    assert done.usage.prompt_tokens == len(server.conductor.tokenizer.encode(PROMPT))
    by_ids = await client.complete(
        server.conductor.tokenizer.encode(PROMPT), max_tokens=5, **GREEDY
    )
    assert by_ids.token_ids == done.token_ids


@pytest.mark.timeout(30)
async def test_chat_returns_a_typed_chat_completion(served: tuple[Server, AsyncClient]) -> None:
    _, client = served
    done = await client.chat(MESSAGES, max_tokens=4, **GREEDY)
    assert isinstance(done, ChatCompletion)
    assert done.choices[0].message.role == "assistant"
    assert done.text == done.choices[0].message.content and done.text
    assert done.finish_reason == "length" and done.usage.completion_tokens == 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_stream_yields_the_deltas_of_the_whole_text(
    served: tuple[Server, AsyncClient], chat: bool
) -> None:
    _, client = served
    prompt = MESSAGES if chat else PROMPT
    whole = await (client.chat if chat else client.complete)(prompt, max_tokens=16, **GREEDY)
    pieces = [t async for t in client.stream(prompt, max_tokens=16, **GREEDY)]
    assert len(pieces) > 1
    assert "".join(pieces) == whole.text


@pytest.mark.timeout(30)
async def test_generate_returns_ids_and_text(served: tuple[Server, AsyncClient]) -> None:
    server, client = served
    ids = server.conductor.tokenizer.encode(PROMPT)
    out = await client.generate(ids, max_tokens=4, **GREEDY)
    assert isinstance(out, Generation)
    assert len(out.output_ids) == 4 and out.finish_reason == "length"
    assert out.prompt_tokens == len(ids)
    assert out.text == server.conductor.tokenizer.decode(out.output_ids)


@pytest.mark.timeout(30)
async def test_health_and_models(served: tuple[Server, AsyncClient]) -> None:
    server, client = served
    assert await client.models() == [MODEL]
    health = await client.health()
    assert health.ok and health.reason is None
    server.conductor.fail("rank 1 is gone: link closed")
    health = await client.health()
    assert not health.ok and health.reason == "rank 1 is gone: link closed"


@pytest.mark.timeout(30)
async def test_refusals_raise_api_error_with_the_servers_message(
    served: tuple[Server, AsyncClient],
) -> None:
    _, client = served
    with pytest.raises(ApiError) as bad:
        await client.complete(PROMPT, max_tokens=10**6)
    assert bad.value.status == 400 and bad.value.param == "max_tokens"
    assert "512" in bad.value.message
    with pytest.raises(ApiError) as unknown:
        await client.complete(PROMPT, model="gpt-9")
    assert unknown.value.status == 404 and unknown.value.code == "model_not_found"
    with pytest.raises(ApiError) as streamed:
        async for _ in client.stream(PROMPT, top_p=0):
            pass
    assert streamed.value.status == 400 and "top_p" in streamed.value.message


@pytest.mark.timeout(30)
async def test_api_key_is_sent_as_a_bearer_token() -> None:
    async with serving(api_key="s3cret") as server:
        async with AsyncClient(server.url, api_key="wrong") as wrong:
            with pytest.raises(ApiError) as refused:
                await wrong.complete(PROMPT, max_tokens=2)
            assert refused.value.status == 401
            assert (await wrong.health()).ok  # health needs no key
        async with AsyncClient(server.url, api_key="s3cret", model=MODEL) as right:
            assert (await right.complete(PROMPT, max_tokens=2)).usage.completion_tokens == 2


@pytest.mark.timeout(30)
async def test_error_mid_stream_raises_api_error(served: tuple[Server, AsyncClient]) -> None:
    server, client = served
    with pytest.raises(ApiError) as failed:
        async for _ in client.stream(PROMPT, max_tokens=480, **GREEDY):
            server.conductor.fail("rank 2 is gone: link closed")
    assert failed.value.status == 500 and "rank 2 is gone" in failed.value.message


@pytest.mark.timeout(30)
async def test_leaving_a_stream_early_aborts_the_request(
    served: tuple[Server, AsyncClient],
) -> None:
    server, client = served
    async with contextlib.aclosing(client.stream(PROMPT, max_tokens=480, **GREEDY)) as pieces:
        async for _ in pieces:
            [handle] = server.conductor.handles.values()
            break
    await server.assert_no_kv_held()
    assert handle.req.finish_reason == "abort" and len(handle.req.output) < 480


@pytest.mark.timeout(30)
async def test_a_stream_event_longer_than_the_readers_buffer_arrives() -> None:
    """An echoed prompt's logprobs make one event of megabytes; aiohttp's
    line reader gives up past 512 KiB (it raised LineTooLong here)."""
    prompt = "hello world " * 500
    body = dict(max_tokens=2, echo=True, logprobs=20, **GREEDY)
    async with serving(max_model_len=2048) as server, AsyncClient(server.url) as client:
        whole = await client.complete(prompt, **body)
        assert len(msgspec.json.encode(whole)) > 1 << 19  # aiohttp's line limit: 512 KiB
        assert "".join([t async for t in client.stream(prompt, **body)]) == whole.text


@pytest.mark.timeout(30)
async def test_close_ends_a_stream_another_task_reads(
    served: tuple[Server, AsyncClient],
) -> None:
    server, client = served
    got: list[str] = []

    async def read() -> None:
        async for text in client.stream(PROMPT, max_tokens=480, **GREEDY):
            got.append(text)

    reader = asyncio.create_task(read())
    while len(got) < 3:
        await asyncio.sleep(0.01)
    await client.close()
    with pytest.raises(ConnectionFailed, match="closed"):
        await asyncio.wait_for(reader, 10)
    await server.assert_no_kv_held()


@pytest.mark.timeout(30)
async def test_stream_parameters_are_checked_before_sending(
    served: tuple[Server, AsyncClient],
) -> None:
    _, client = served
    with pytest.raises(ValueError, match="use stream"):
        await client.complete(PROMPT, max_tokens=2, stream=True)
    with pytest.raises(ValueError, match="use stream"):
        await client.chat(MESSAGES, max_tokens=2, stream=True)
    with pytest.raises(ValueError, match="one choice"):
        await anext(client.stream(PROMPT, n=2))
    # null is the default, as the server takes it
    assert [t async for t in client.stream(PROMPT, max_tokens=3, n=None, **GREEDY)]


@contextlib.asynccontextmanager
async def misbehaving() -> AsyncIterator[str]:
    """A server that answers as no ringserve does: slowly, cut off, with a
    page that is not the API's, or refusing with Retry-After."""
    from aiohttp import web

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "cmpl-1", "obj')
        request.transport.close()  # gone before [DONE], mid-answer
        return resp

    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html>a proxy's page</html>", content_type="text/html")

    async def odd_event(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [1, 2]\n\n")
        return resp

    async def busy(request: web.Request) -> web.Response:
        error = {"error": {"message": "queue full", "type": "requests", "param": None,
                           "code": "rate_limit_exceeded"}}  # fmt: skip
        return web.json_response(error, status=429, headers={"Retry-After": "1"})

    app = web.Application()
    app.router.add_post("/slow/v1/completions", slow)
    app.router.add_post("/cut/v1/completions", cut)
    app.router.add_post("/page/v1/completions", page)
    app.router.add_post("/odd/v1/completions", odd_event)
    app.router.add_post("/busy/v1/completions", busy)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.timeout(30)
async def test_every_failure_is_an_api_error_with_what_went_wrong() -> None:
    from tests.launched import free_port

    async with AsyncClient(f"http://127.0.0.1:{free_port()}") as nobody:
        with pytest.raises(ConnectionFailed) as failed:
            await nobody.complete("hi")
        assert (failed.value.status, failed.value.code) == (503, "unreachable")
        with pytest.raises(ConnectionFailed, match="cannot reach"):
            await nobody.health()
    async with misbehaving() as url:
        async with AsyncClient(url + "/slow", timeout_s=0.3) as client:
            with pytest.raises(ConnectionFailed) as failed:
                await client.complete("hi")
            assert (failed.value.status, failed.value.code) == (504, "timeout")
        async with AsyncClient(url + "/cut/v1/") as client:  # the openai package's form
            with pytest.raises(ConnectionFailed) as failed:
                _ = [t async for t in client.stream("hi")]
            assert (failed.value.status, failed.value.code) == (502, "broken")
        for where in ("/page", "/odd"):
            async with AsyncClient(url + where) as client:
                with pytest.raises(ConnectionFailed) as failed:
                    if where == "/page":
                        await client.complete("hi")
                    else:
                        _ = [t async for t in client.stream("hi")]
                assert (failed.value.status, failed.value.code) == (502, "bad_answer")
        async with AsyncClient(url + "/busy") as client:
            with pytest.raises(ApiError) as refused:
                await client.complete("hi")
            assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
            assert refused.value.code == "rate_limit_exceeded"


@pytest.mark.timeout(30)
async def test_the_openai_packages_base_url_form_and_tools_in_a_stream(
    served: tuple[Server, AsyncClient],
) -> None:
    server, _ = served
    async with AsyncClient(server.url + "/v1/") as client:
        assert (await client.complete(PROMPT, max_tokens=2, **GREEDY)).usage.completion_tokens == 2
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        with pytest.raises(ValueError, match="a tool call is not text: use chat"):
            await anext(client.stream(MESSAGES, tools=tools, tool_choice="required"))
