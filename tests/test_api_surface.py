"""The request surface a vLLM user expects: penalties and bias over HTTP,
`echo`, `/tokenize` and `/detokenize`, vLLM's extension fields refused by
name; offline, `n` choices in `RequestOutput.outputs` and `LLM.chat`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ringserve import LLM, SamplingParams
from ringserve.params import CompletionOutput
from tests.test_http import GREEDY, MESSAGES, PROMPT, Server, serving


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as s:
        yield s


@pytest.mark.timeout(30)
async def test_logit_bias_and_penalties_reach_the_sampler(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, **GREEDY}
    status, biased = await server.post("/v1/completions", {**body, "logit_bias": {"77": 100}})
    assert status == 200, biased
    assert biased["choices"][0]["token_ids"] == [77] * 6
    _, penalized = await server.post(
        "/v1/completions", {**body, "logit_bias": {"77": 100}, "frequency_penalty": 2.0}
    )
    assert penalized["choices"][0]["token_ids"] == [77] * 6  # 100 outweighs 2 x 5
    _, allowed = await server.post(
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 6, "allowed_token_ids": [50, 60], **GREEDY},
    )
    assert set(allowed["choices"][0]["token_ids"]) <= {50, 60}


@pytest.mark.timeout(30)
async def test_echo_puts_the_prompt_before_the_completion(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    _, plain = await server.post("/v1/completions", body)
    status, echoed = await server.post("/v1/completions", {**body, "echo": True})
    assert status == 200, echoed
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    events = await server.events("/v1/completions", {**body, "echo": True})
    text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    assert text == echoed["choices"][0]["text"]


@pytest.mark.timeout(30)
async def test_tokenize_and_detokenize_round_trip(server: Server) -> None:
    tok = server.conductor.tokenizer
    status, body = await server.post("/tokenize", {"prompt": PROMPT})
    assert status == 200, body
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.conductor.scheduler.config.max_model_len
    _, chat = await server.post("/tokenize", {"messages": MESSAGES})
    rendered = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert chat["tokens"] == rendered
    status, back = await server.post("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == tok.decode(body["tokens"], skip_special_tokens=False)
    _, chat_back = await server.post("/detokenize", {"tokens": chat["tokens"]})
    assert chat_back["prompt"] == tok.apply_chat_template(MESSAGES)  # its markers included
    status, both = await server.post("/tokenize", {"prompt": "a", "messages": MESSAGES})
    assert status == 400 and both["error"]["param"] == "prompt"


@pytest.mark.timeout(60)
def test_n_choices_come_back_as_one_output_with_vllms_shape():
    with LLM() as llm:
        (out,) = llm.generate(
            "a prompt", SamplingParams(n=3, max_tokens=5, seed=9, ignore_eos=True)
        )
        alone = llm.generate("a prompt", SamplingParams(max_tokens=5, seed=10, ignore_eos=True))
        chat = llm.chat(
            [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0)
        )
        tok = llm.tokenizer
        two = llm.chat(
            [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]],
            SamplingParams(max_tokens=4, temperature=0),
        )
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(isinstance(o, CompletionOutput) and len(o.token_ids) == 5 for o in out.outputs)
    assert out.outputs[1].token_ids == alone[0].outputs[0].token_ids  # choice i: seed + i
    assert out.token_ids == out.outputs[0].token_ids and out.prompt == "a prompt"
    assert out.finished
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[0].prompt == rendered
    assert chat[0].prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert two[0].outputs[0].token_ids == chat[0].outputs[0].token_ids and len(two) == 2
