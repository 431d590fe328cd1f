"""The HTTP API, served for real: the aiohttp app on a loopback port over a
single-rank conductor running the built-in model, hit with aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from ringserve.cache.census import check_census
from ringserve.config import EngineConfig
from ringserve.engine.conductor import Conductor
from ringserve.http.app import ROUTES, create_app
from ringserve.http.options import HttpOptions
from ringserve.launch.serve import build_conductor
from ringserve.models.builtin import builtin_model_dir
from ringserve.plan.sizing import size_ring
from tests.model_factory import llama_deep

MODEL = "ringserve-builtin"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Server:
    url: str
    conductor: Conductor
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body, **kw) as resp:
            return resp.status, await _body(resp)

    async def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.get(self.url + path, **kw) as resp:
            return resp.status, await _body(resp)

    async def events(self, path: str, body: dict[str, Any]) -> list[Any]:
        """Every `data:` payload of a stream, JSON-decoded but for [DONE]."""
        async with self.session.post(self.url + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
        payloads = [b[len("data: ") :] for b in text.split("\n\n") if b.startswith("data: ")]
        return [p if p == "[DONE]" else json.loads(p) for p in payloads]

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not self.conductor.scheduler.idle or self.conductor.handles:
                await asyncio.sleep(0.01)

    async def assert_no_kv_held(self) -> None:
        await self.wait_idle()
        census = self.conductor.scheduler.census()
        check_census(census)
        assert census.held_by_running == 0 and census.cached_locked == 0, census

    async def assert_serving(self) -> None:
        """Health is green and an ordinary request still works."""
        assert await self.get("/health") == (200, {"status": "ok"})
        status, body = await self.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200, body
        assert len(body["choices"][0]["token_ids"]) >= 1


async def _body(resp: aiohttp.ClientResponse) -> Any:
    if resp.content_type == "application/json":
        return await resp.json()
    return await resp.text()


@contextlib.asynccontextmanager
async def serving(
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    plan: dict[str, Any] | None = None,
    max_model_len: int = 512,
    model_dir: Path | None = None,
    http: dict[str, Any] | None = None,
    **engine: Any,
) -> AsyncIterator[Server]:
    """A real server on 127.0.0.1 over a real single-rank conductor;
    `engine`: more EngineConfig options, `http` more HttpOptions."""
    config = EngineConfig(
        model_dir=model_dir or builtin_model_dir(),
        kv_capacity_tokens=engine.pop("kv_capacity_tokens", 4096),
        max_model_len=max_model_len,
        **engine,
    )
    conductor = build_conductor(config)
    running = asyncio.create_task(conductor.run())
    options = HttpOptions(
        port=0, api_key=api_key, model_name=MODEL, max_body_bytes=max_body_bytes, **(http or {})
    )
    runner = web.AppRunner(create_app(conductor, options, plan))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            yield Server(f"http://127.0.0.1:{port}", conductor, session)
    finally:
        await runner.cleanup()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        conductor.executor.shutdown(wait=True)
        conductor.mask_executor.shutdown(wait=True)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as s:
        yield s


def openai_client(server: Server) -> openai.AsyncOpenAI:
    """The official client against `server`, failing at once (no retries)."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _text_of(chunks: list[Any], chat: bool) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(c) for chunk in chunks for c in chunk["choices"])


# ---- generation ---------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_completion_answers_text_token_ids_and_usage(server: Server) -> None:
    status, body = await server.post(
        "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, **GREEDY}
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == MODEL
    [choice] = body["choices"]
    tok = server.conductor.tokenizer
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert choice["text"] == tok.decode(choice["token_ids"])
    prompt_tokens = len(tok.encode(PROMPT))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 6,
        "total_tokens": prompt_tokens + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    await server.assert_no_kv_held()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_streamed_text_equals_non_streamed_text_under_greedy(
    server: Server, chat: bool
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 24, **GREEDY} | ({"messages": MESSAGES} if chat else {"prompt": PROMPT})
    status, whole = await server.post(path, body)
    assert status == 200, whole
    events = await server.events(path, body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    [choice] = whole["choices"]
    expected = choice["message"]["content"] if chat else choice["text"]
    assert _text_of(chunks, chat) == expected and expected
    assert [t for c in chunks for t in c["choices"][0]["token_ids"] or []] == choice["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[0]["object"] == "chat.completion.chunk"


@pytest.mark.timeout(30)
async def test_stream_sends_usage_chunk_only_when_asked(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, **GREEDY}
    plain = await server.events("/v1/completions", body)
    assert all(e == "[DONE]" or e["usage"] is None for e in plain)
    asked = await server.events(
        "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    usage_chunk = asked[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["prompt_tokens"] == len(server.conductor.tokenizer.encode(PROMPT))


@pytest.mark.timeout(30)
async def test_chat_renders_the_chat_template(server: Server) -> None:
    tok = server.conductor.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    status, chat = await server.post(
        "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, **GREEDY}
    )
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == len(ids)
    status, native = await server.post(
        "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 8, **GREEDY}}
    )
    assert status == 200, native
    assert chat["choices"][0]["token_ids"] == native["output_ids"]
    assert chat["choices"][0]["message"] == {"content": native["text"], "role": "assistant"}


@pytest.mark.timeout(30)
async def test_chat_default_max_tokens_fills_the_context() -> None:
    async with serving(max_model_len=64) as small:
        status, body = await small.post(
            "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True}
        )
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert body["choices"][0]["finish_reason"] == "length"


async def test_stop_strings_on_a_model_without_a_tokenizer_are_refused_by_name(tmp_path) -> None:
    """They are matched in text, which such a model never writes: refused,
    as bad_words are, instead of never firing."""
    async with serving(model_dir=llama_deep(tmp_path)) as bare:
        ask = {"prompt": [5, 6, 7], "max_tokens": 2}
        status, body = await bare.post("/v1/completions", {**ask, "stop": ["x"]})
        assert status == 400 and body["error"]["param"] == "stop", body
        assert "stop strings need a tokenizer" in body["error"]["message"]
        status, body = await bare.post("/v1/completions", ask)
        assert status == 200, body


@pytest.mark.timeout(30)
async def test_n_choices_with_a_seed_sample_with_seed_plus_i(server: Server) -> None:
    sampled = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    status, body = await server.post("/v1/completions", {**sampled, "n": 3, "seed": 40})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for i, choice in enumerate(body["choices"]):
        _, alone = await server.post("/v1/completions", {**sampled, "seed": 40 + i})
        assert alone["choices"][0]["token_ids"] == choice["token_ids"]
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1
    assert body["usage"]["completion_tokens"] == 24


@pytest.mark.timeout(30)
async def test_stop_string_cuts_the_text(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, **GREEDY}
    _, whole = await server.post("/v1/completions", body)
    text = whole["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    _, cut = await server.post("/v1/completions", {**body, "stop": [stop, "\x00never"]})
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["stop_reason"] == stop  # vLLM's: which stop ended it
    assert whole["choices"][0]["stop_reason"] is None  # its length did
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, **GREEDY}
    _, said = await server.post("/v1/chat/completions", chat)
    reply = said["choices"][0]["message"]["content"]
    stop = reply[len(reply) // 2 : len(reply) // 2 + 3]
    events = await server.events("/v1/chat/completions", {**chat, "stop": stop, "stream": True})
    last = [c for e in events if e != "[DONE]" for c in e["choices"]][-1]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stop_string_the_last_allowed_token_completes_is_a_stop(
    server: Server, stream: bool
) -> None:
    """The pass that brings the stop string's last token also reaches
    max_tokens: the text ends at the stop string, and so does the reason."""
    body = {"prompt": PROMPT, "max_tokens": 12, **GREEDY}
    _, whole = await server.post("/v1/completions", body)
    text = whole["choices"][0]["text"]
    stop = next(text[-k:] for k in range(1, len(text)) if text.index(text[-k:]) == len(text) - k)
    asked = {**body, "stop": stop, "stream": stream}
    if stream:
        events = await server.events("/v1/completions", asked)
        pieces = [c for e in events if e != "[DONE]" for c in e["choices"]]
        last = pieces[-1]
        got = "".join(c["text"] for c in pieces), last["finish_reason"], last["stop_reason"]
    else:
        _, cut = await server.post("/v1/completions", asked)
        choice = cut["choices"][0]
        got = choice["text"], choice["finish_reason"], choice["stop_reason"]
    assert got == (text[: -len(stop)], "stop", stop)


@pytest.mark.timeout(30)
async def test_stop_token_id_ends_generation_at_that_token(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, **GREEDY}
    _, whole = await server.post("/v1/completions", body)
    ids = whole["choices"][0]["token_ids"]
    stop_id = ids[3]
    _, cut = await server.post("/v1/completions", {**body, "stop_token_ids": [stop_id]})
    assert cut["choices"][0]["token_ids"] == ids[: ids.index(stop_id) + 1]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["stop_reason"] == stop_id
    # its text is not the output's, as vLLM leaves it out
    tok = server.conductor.tokenizer
    assert cut["choices"][0]["text"] == tok.decode(ids[: ids.index(stop_id)])


@pytest.mark.timeout(30)
async def test_completion_logprobs_in_openai_format(server: Server) -> None:
    status, body = await server.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "logprobs": 2, **GREEDY}
    )
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    tok = server.conductor.tokenizer
    strings = [tok.decode([t], skip_special_tokens=False) for t in choice["token_ids"]]
    assert lp["tokens"] == strings
    assert len(lp["token_logprobs"]) == 5 and all(x <= 0 for x in lp["token_logprobs"])
    assert all(1 <= len(alts) <= 2 for alts in lp["top_logprobs"])
    # Greedy: the sampled token is the most likely one.
    assert all(
        max(alts.values()) == x
        for alts, x in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True)
    )
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(strings[0])


@pytest.mark.timeout(30)
async def test_chat_logprobs_in_openai_format(server: Server) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 3, **GREEDY}
    status, whole = await server.post("/v1/chat/completions", body)
    assert status == 200, whole
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for record in content:
        assert set(record) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(record["top_logprobs"]) == 3
        assert record["top_logprobs"][0]["logprob"] == record["logprob"]
    streamed = await server.events("/v1/chat/completions", body)
    records = [
        r
        for c in streamed[1:-1]
        for r in (c["choices"][0]["logprobs"] or {"content": []})["content"]
    ]
    # The streamed run reuses the cached prompt, so logprobs agree to rounding only.
    assert [r["token"] for r in records] == [r["token"] for r in content]
    assert [r["logprob"] for r in records] == pytest.approx(
        [r["logprob"] for r in content], abs=1e-4
    )


@pytest.mark.timeout(30)
async def test_prompt_forms_token_ids_and_lists(server: Server) -> None:
    ids = server.conductor.tokenizer.encode(PROMPT)
    body = {"max_tokens": 4, **GREEDY}
    _, by_text = await server.post("/v1/completions", {**body, "prompt": PROMPT})
    _, by_ids = await server.post("/v1/completions", {**body, "prompt": ids})
    assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    _, lists = await server.post("/v1/completions", {**body, "prompt": [ids, ids[:2]]})
    assert lists["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    assert lists["usage"]["prompt_tokens"] == len(ids) + 2
    status, two = await server.post(
        "/v1/completions", {**body, "prompt": [PROMPT, "Hello"], "n": 2}
    )
    assert status == 200, two
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert two["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]


@pytest.mark.timeout(30)
async def test_generate_native_and_streamed(server: Server) -> None:
    ids = server.conductor.tokenizer.encode(PROMPT)
    body = {"input_ids": ids, "sampling_params": {"max_tokens": 6, **GREEDY}}
    status, out = await server.post("/generate", body)
    assert status == 200, out
    assert len(out["output_ids"]) == 6 and out["finish_reason"] == "length"
    assert out["prompt_tokens"] == len(ids)
    assert out["text"] == server.conductor.tokenizer.decode(out["output_ids"])
    events = await server.events("/generate", body)
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["output_ids"]] == out["output_ids"]
    assert "".join(e["text"] for e in events[:-1]) == out["text"]
    assert events[-2]["finish_reason"] == "length" and events[-2]["cached_tokens"] >= 1


# ---- bad input --------------------------------------------------------------------

LONG_PROMPT = list(range(10, 10 + 600))
BAD_REQUESTS = {
    "malformed_json": ("/v1/completions", b'{"prompt": "x",', 400, None),
    "not_an_object": ("/v1/completions", b"[1, 2]", 400, None),
    "number_out_of_range": (
        "/v1/completions",
        b'{"prompt": "x", "temperature": 1e400}',
        400,
        "temperature",
    ),
    "nested_number_out_of_range": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -1e999}}',
        400,
        "logit_bias.5",
    ),
    "missing_prompt": ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    "bias_not_a_number": (
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"5": "x"}},
        400,
        "logit_bias",
    ),
    "not_utf8": ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, None),
    "wrong_type": ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
    "negative_max_tokens": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": -5},
        400,
        "max_tokens",
    ),
    "absurd_max_tokens": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 10**6},
        400,
        "max_tokens",
    ),
    "prompt_over_context": ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    "prompt_and_max_tokens_over_context": (
        "/v1/completions",
        {"prompt": LONG_PROMPT[:500], "max_tokens": 20},
        400,
        "max_tokens",
    ),
    "messages_and_completion_tokens_over_context": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x " * 200}], "max_completion_tokens": 400},
        400,
        "max_completion_tokens",
    ),
    "second_prompt_over_context": (
        "/v1/completions",
        {"prompt": [[5, 6, 7], LONG_PROMPT]},
        400,
        "prompt",
    ),
    "token_out_of_vocab": ("/v1/completions", {"prompt": [5, 10**6]}, 400, "prompt"),
    "mixed_prompt_forms": ("/v1/completions", {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    "empty_prompt": ("/v1/completions", {"prompt": []}, 400, "prompt"),
    "bad_top_p": ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    "empty_stop": ("/v1/completions", {"prompt": PROMPT, "stop": ""}, 400, "stop"),
    "too_many_choices": ("/v1/completions", {"prompt": PROMPT, "n": 99}, 400, "n"),
    "suffix": ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, 400, "suffix"),
    "vllm_beam_search": (
        "/v1/completions",
        {"prompt": PROMPT, "use_beam_search": True},
        400,
        "use_beam_search",
    ),
    "prompt_logprobs_out_of_range": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "prompt_logprobs": 99},
        400,
        "prompt_logprobs",
    ),
    "bias_out_of_vocab": (
        "/v1/completions",
        {"prompt": PROMPT, "logit_bias": {"999999": 5}},
        400,
        "logit_bias",
    ),
    "bias_not_an_id": (
        "/v1/completions",
        {"prompt": PROMPT, "logit_bias": {"abc": 5}},
        400,
        "logit_bias",
    ),
    "penalty_out_of_range": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    "unknown_model": ("/v1/completions", {"prompt": PROMPT, "model": "gpt-9"}, 404, "model"),
    "no_messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "unknown_role": (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    "image_part": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    "top_logprobs_alone": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    "absurd_completion_tokens": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 9999},
        400,
        "max_completion_tokens",
    ),
    "generate_typo": (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_token": 3}},
        400,
        "sampling_params",
    ),
    "generate_neither": ("/generate", {"sampling_params": {}}, 400, "input_ids"),
    "stop_token_out_of_vocab": (
        "/v1/completions",
        {"prompt": PROMPT, "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
    ),
    "template_kwargs_set_messages": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "chat_template_kwargs": {"messages": 5}},
        400,
        "chat_template_kwargs",
    ),
    "nested_deeper_than_a_body_may": (
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2, "user": ' + b"[" * 500 + b"]" * 500 + b"}",
        400,
        None,
    ),
    "nested_deeper_than_the_decoder_goes": (
        "/v1/completions",
        b'{"prompt": "hi", "guided_json": ' + b'{"a":' * 100000 + b"1" + b"}" * 100001,
        400,
        None,
    ),
    "legacy_functions": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "functions": [{"name": "f", "parameters": {}}]},
        400,
        "functions",
    ),
}


_CONTEXT_EXCEEDED = {
    "absurd_max_tokens",
    "prompt_over_context",
    "prompt_and_max_tokens_over_context",
    "messages_and_completion_tokens_over_context",
    "second_prompt_over_context",
    "absurd_completion_tokens",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_bad_input_is_refused_with_a_message_and_disturbs_nothing(
    server: Server, case: str
) -> None:
    path, body, status, param = BAD_REQUESTS[case]
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with server.session.post(server.url + path, **kw) as resp:
        assert resp.status == status, await resp.text()
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if case == "unknown_model":
        assert error["code"] == "model_not_found"
    if case in _CONTEXT_EXCEEDED:  # OpenAI's code, whichever of the lengths is too long
        assert error["code"] == "context_length_exceeded", error
    await server.wait_idle()
    assert server.conductor.metrics.generation_tokens == 0  # nothing of it ran
    await server.assert_serving()
    await server.assert_no_kv_held()


@pytest.mark.timeout(30)
async def test_body_over_the_size_limit_is_413() -> None:
    async with serving(max_body_bytes=2048) as server:
        status, body = await server.post("/v1/completions", {"prompt": "x" * 4096})
        assert status == 413, body
        assert "2048" in body["error"]["message"]
        await server.assert_serving()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_not_in_its_declared_encoding_is_400(server: Server, encoding: str) -> None:
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    body = b'{"prompt": "hi", "max_tokens": 2}'
    async with server.session.post(
        server.url + "/v1/completions", data=body, headers=headers
    ) as resp:
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    assert error["code"] == "invalid_body" and encoding in error["message"], error
    await server.assert_serving()


@pytest.mark.timeout(30)
async def test_unknown_route_is_404_and_wrong_method_is_405(server: Server) -> None:
    status, body = await server.get("/v2/nothing")
    assert status == 404 and "/v2/nothing" in body["error"]["message"]
    async with server.session.get(server.url + "/v1/completions") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
    await server.assert_serving()


@pytest.mark.timeout(30)
async def test_api_key_is_required_except_on_health_and_metrics() -> None:
    async with serving(api_key="s3cret") as server:
        body = {"prompt": PROMPT, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, answer = await server.post("/v1/completions", body, headers=headers)
            assert status == 401, answer
            assert answer["error"]["code"] == "invalid_api_key"
        assert (await server.get("/v1/models"))[0] == 401
        good = {"Authorization": "Bearer s3cret"}
        assert (await server.post("/v1/completions", body, headers=good))[0] == 200
        # bytes that are not UTF-8 in the header: a refusal, not a 500
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
            b"Connection: close\r\n\r\n"
        )
        status_line = await reader.readline()
        writer.close()
        assert status_line.split()[1] == b"401", status_line
        assert (await server.get("/health"))[0] == 200
        assert (await server.get("/metrics"))[0] == 200


# ---- disconnects ----------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_client_that_disconnects_mid_stream_aborts_and_frees_its_kv(
    server: Server,
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 480, "stream": True, **GREEDY}
    async with aiohttp.ClientSession() as raw:
        resp = await raw.post(server.url + "/v1/completions", json=body)
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        [handle] = server.conductor.handles.values()
        req = handle.req
        resp.close()  # drop the connection, not just the response
    await server.assert_no_kv_held()
    assert req.finish_reason == "abort"
    assert len(req.output) < 480
    await server.assert_serving()


@pytest.mark.timeout(30)
async def test_client_gone_while_waiting_for_a_whole_completion_aborts_it(
    server: Server,
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 480, **GREEDY}
    async with aiohttp.ClientSession() as raw:
        request = asyncio.create_task(raw.post(server.url + "/v1/completions", json=body))
        async with asyncio.timeout(5):
            while not server.conductor.handles:
                await asyncio.sleep(0.005)
        [handle] = server.conductor.handles.values()
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
    await server.assert_no_kv_held()
    assert handle.req.finish_reason == "abort"
    assert len(handle.req.output) < 480


# ---- health, metrics, models, plan, openapi ----------------------------------------------


@pytest.mark.timeout(30)
async def test_health_is_503_with_the_reason_while_a_wait_is_overdue(server: Server) -> None:
    token = server.conductor.health.suspect("rank 0 waits Output of pass 7 from rank 2")
    status, body = await server.get("/health")
    assert status == 503
    assert body == {"status": "unhealthy", "reason": "rank 0 waits Output of pass 7 from rank 2"}
    server.conductor.health.clear(token)
    assert (await server.get("/health"))[0] == 200
    _, text = await server.get("/metrics")
    assert "ringserve_wedge_suspicions_total 1.0" in text.splitlines()


@pytest.mark.timeout(30)
async def test_failed_ring_answers_503_to_health_and_to_requests(server: Server) -> None:
    server.conductor.fail("rank 1 is gone: link closed")
    status, body = await server.get("/health")
    assert status == 503 and body["reason"] == "rank 1 is gone: link closed"
    status, body = await server.post("/v1/completions", {"prompt": PROMPT})
    assert status == 503 and "rank 1 is gone" in body["error"]["message"]
    assert body["error"]["type"] == "server_error"


@pytest.mark.timeout(30)
async def test_a_request_cut_off_by_a_shutdown_is_503() -> None:
    from ringserve.http.submission import SHUTTING_DOWN

    async with serving() as stopped:
        body = {"prompt": PROMPT, "max_tokens": 480, **GREEDY}
        asking = asyncio.create_task(stopped.post("/v1/completions", body))
        while not stopped.conductor.handles:
            await asyncio.sleep(0.01)
        # the server's own stop (http/server.py): drain, stop the conductor, end the rest
        await stopped.conductor.drain(0.0)
        for task in stopped.conductor._tasks:
            task.cancel()
        stopped.conductor.desk.fail_all(SHUTTING_DOWN)
        status, answer = await asking
    assert status == 503 and answer["error"]["code"] == "server_shutting_down", answer
    assert "shutting down" in answer["error"]["message"]


@pytest.mark.timeout(30)
async def test_ring_failure_mid_stream_ends_the_stream_with_an_error_event(
    server: Server,
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 480, "stream": True, **GREEDY}
    async with server.session.post(server.url + "/v1/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        server.conductor.fail("rank 2 is gone: link closed")
        rest = (await resp.read()).decode()
    events = [b for b in rest.split("\n\n") if b]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert "rank 2 is gone" in error["message"] and error["type"] == "server_error"


@pytest.mark.timeout(30)
async def test_metrics_expose_counters_and_kv_gauges(server: Server) -> None:
    await server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, **GREEDY})
    status, text = await server.get("/metrics")
    assert status == 200
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    allocator = server.conductor.scheduler.allocator
    assert values["ringserve_requests_total"] == 1
    assert values["ringserve_generation_tokens_total"] == 3
    assert values["ringserve_queue_depth"] == 0 and values["ringserve_requests_running"] == 0
    assert values["ringserve_kv_slots_free"] == allocator.available
    assert values["ringserve_kv_slots_used"] == allocator.used > 0
    assert values["ringserve_kv_slots_cached"] == server.conductor.scheduler.cache.total_size
    assert "# TYPE ringserve_kv_slots_free gauge" in text
    # vLLM's names: the request's slots are all in the prefix cache now, evictable, so free
    assert values[f'ringserve:kv_cache_usage_perc{{model_name="{MODEL}"}}'] == 0.0
    assert values[f'ringserve:generation_tokens_total{{model_name="{MODEL}"}}'] == 3
    assert values[f'ringserve:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}'] == 1


@pytest.mark.timeout(30)
async def test_each_finish_reason_is_exported_before_its_first_request() -> None:
    """A dashboard's panel of finished requests reads 0, not 'no data', on a
    server that has not yet finished one for that reason."""
    async with serving() as fresh:
        _, text = await fresh.get("/metrics")
        await fresh.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **GREEDY})
        _, after = await fresh.get("/metrics")

    def success(text: str, reason: str) -> float:
        key = f'ringserve:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}}'
        (line,) = [x for x in text.splitlines() if x.startswith(key + " ")]
        return float(line.split()[-1])

    assert [success(text, r) for r in ("stop", "length", "abort")] == [0, 0, 0]
    assert [success(after, r) for r in ("stop", "length", "abort")] == [0, 1, 0]


@pytest.mark.timeout(30)
async def test_models_plan_and_openapi_describe_the_server() -> None:
    _, solved = size_ring(EngineConfig(model_dir=builtin_model_dir()), 1, [2000])
    plan = solved.to_dict()
    async with serving(plan=plan) as server:
        status, models = await server.get("/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 512
        assert await server.get("/v1/plan") == (200, plan)
        status, spec = await server.get("/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")
    assert {(p, m.upper()) for p, ops in spec["paths"].items() for m in ops} == {
        (r.path, r.method) for r in ROUTES
    }
    refs = json.dumps(spec).split('"$ref": "#/components/schemas/')[1:]
    assert all(ref.split('"')[0] in spec["components"]["schemas"] for ref in refs)
    async with serving() as server:
        status, body = await server.get("/v1/plan")
        assert status == 404 and body["error"]["code"] == "not_found"
    # with a host tier, its figures too
    config = EngineConfig(model_dir=builtin_model_dir(), host_kv_tokens=256)
    tiered = size_ring(config, 1, [2000])[1].to_dict()
    assert tiered["host_tokens"] == 256 and "host_kv" in tiered["ranks"][0]
    async with serving(plan=tiered) as server:
        assert await server.get("/v1/plan") == (200, tiered)


@pytest.mark.timeout(30)
async def test_concurrent_requests_all_complete_and_release_their_kv(server: Server) -> None:
    bodies = [{"prompt": f"{PROMPT} number {i}", "max_tokens": 8, **GREEDY} for i in range(6)]
    answers = await asyncio.gather(*(server.post("/v1/completions", b) for b in bodies))
    assert all(status == 200 and len(b["choices"][0]["token_ids"]) == 8 for status, b in answers)
    await server.assert_no_kv_held()


@pytest.mark.timeout(30)
async def test_openapi_states_the_served_limits_and_the_server_takes_what_it_states(
    server: Server,
) -> None:
    status, spec = await server.get("/openapi.json")
    assert status == 200
    fields = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["max_tokens"]["anyOf"][0]["maximum"] == 512
    assert fields["model"]["anyOf"][0]["const"] == MODEL
    ids = fields["prompt"]["oneOf"][2]
    assert ids["items"]["maximum"] == server.conductor.vocab_size - 1
    # JSON Schema's integer includes 2.0; top_k 0 is within its range and means off
    body = {"prompt": PROMPT, "max_tokens": 2.0, "top_k": 0, "n": 1.0, **GREEDY}
    status, answer = await server.post("/v1/completions", body)
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == 2, answer
    status, answer = await server.post("/v1/completions", {"prompt": PROMPT, "top_k": 1 << 40})
    assert status == 400 and answer["error"]["param"] == "top_k"
    await server.assert_serving()
