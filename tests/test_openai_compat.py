"""What OpenAI's clients and the tools around them send and expect, through
the official `openai` client where it has a call for it: nulls for
parameters left unset, the `developer` role, a template's own variables,
HEAD on the probes, one model's card, the bytes of every token's logprob,
forced tool calls cut short, and a client that leaves mid-body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
import structlog

from tests.test_http import GREEDY, MESSAGES, MODEL, Server, openai_client, serving

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


client = openai_client


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as s:
        yield s


async def test_a_null_parameter_takes_its_default(server: Server) -> None:
    """The official client sends null for a parameter given as None."""
    unset = dict(n=None, temperature=None, top_p=None, presence_penalty=None, stream=None)
    chat = client(server).chat.completions
    got = await chat.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=3, **unset)
    want = await chat.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=3)
    assert got.choices[0].message.content == want.choices[0].message.content
    status, body = await server.post(
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "echo": None, "logprobs": None, "n": None},
    )
    assert status == 200 and len(body["choices"]) == 1, body
    # and the description says so
    _, spec = await server.get("/openapi.json")
    temperature = spec["components"]["schemas"]["ChatRequest"]["properties"]["temperature"]
    assert {"type": "null"} in temperature["anyOf"]


async def test_developer_messages_render_as_system_ones(server: Server) -> None:
    as_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    as_developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    _, system = await server.post("/tokenize", {"messages": as_system})
    status, developer = await server.post("/tokenize", {"messages": as_developer})
    assert status == 200 and developer["tokens"] == system["tokens"]
    done = await client(server).chat.completions.create(
        model=MODEL, messages=as_developer, max_tokens=2
    )
    assert done.usage.prompt_tokens == len(system["tokens"])


async def test_template_variables_may_turn_the_generation_prompt_off(server: Server) -> None:
    tok = server.conductor.tokenizer
    off = tok.encode(tok.apply_chat_template(MESSAGES, False), add_special_tokens=False)
    on = tok.encode(tok.apply_chat_template(MESSAGES, True), add_special_tokens=False)
    assert off != on
    body = {"messages": MESSAGES, "max_tokens": 1, **GREEDY}
    kwargs = {"chat_template_kwargs": {"add_generation_prompt": False}}
    status, done = await server.post("/v1/chat/completions", {**body, **kwargs})
    assert status == 200, done
    assert done["usage"]["prompt_tokens"] == len(off)


async def test_probes_answer_head_and_a_model_card_is_found_by_its_name(server: Server) -> None:
    for path in ("/health", "/metrics", "/v1/models"):
        async with server.session.head(server.url + path) as resp:
            assert resp.status == 200, path
    card = await client(server).models.retrieve(MODEL)
    assert card.id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client(server).models.retrieve("org/other-model")
    _, spec = await server.get("/openapi.json")
    (param,) = spec["paths"]["/v1/models/{model}"]["get"]["parameters"]
    assert param["name"] == "model" and param["in"] == "path"


async def test_chat_logprob_bytes_rebuild_the_text(server: Server) -> None:
    """Byte-level pieces of one character each show U+FFFD as a string;
    their bytes still join into the text."""
    tok = server.conductor.tokenizer
    chars = "ûé✓"
    pieces = tok.encode(chars, add_special_tokens=False)
    assert len(pieces) > len(chars)  # several tokens a character
    body = {
        "messages": MESSAGES,
        "max_tokens": len(pieces),
        "logprobs": True,
        "top_logprobs": 2,
        "structured_outputs": {"regex": chars},
        **GREEDY,
    }
    status, done = await server.post("/v1/chat/completions", body)
    assert status == 200, done
    records = done["choices"][0]["logprobs"]["content"]
    text = bytes(b for r in records for b in r["bytes"]).decode()
    assert text == done["choices"][0]["message"]["content"] == chars
    assert any("\ufffd" in r["token"] for r in records)
    for r in records:
        for alt in r["top_logprobs"]:
            assert isinstance(alt["bytes"], list)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_forced_call_cut_short_is_the_same_streamed_or_not(
    server: Server, choice: object
) -> None:
    args = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=choice)
    chat = client(server).chat.completions
    for max_tokens in (3, 12):
        whole = await chat.create(**args, max_tokens=max_tokens, temperature=0)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "length"
        assert message.content is None
        calls = {}
        async for chunk in await chat.create(
            **args, max_tokens=max_tokens, temperature=0, stream=True
        ):
            for c in chunk.choices:
                assert not c.delta.content
                for call in c.delta.tool_calls or ():
                    name, sofar = calls.get(call.index, ("", ""))
                    calls[call.index] = (
                        name + (call.function.name or ""),
                        sofar + (call.function.arguments or ""),
                    )
        got = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        assert got == [calls[i] for i in sorted(calls)]
        if isinstance(choice, dict):  # a named call opens at once
            assert got and got[0][0] == "get_weather"


async def test_a_client_gone_mid_body_is_no_server_error(server: Server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                b'{"messages'
            )
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
        await asyncio.sleep(0.3)
    events = [e["event"] for e in logs]
    assert "http.error" not in events and "http.client_gone" in events
    await server.assert_serving()
