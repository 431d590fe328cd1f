"""Prompt logprobs through the HTTP API and the official openai client:
`echo` with `logprobs` puts the prompt's tokens first in the choice's
logprobs (the first with a null logprob), streamed as not; vLLM's
`prompt_logprobs` field on completions and chat."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from tests.test_http import MESSAGES, MODEL, PROMPT, Server, openai_client, serving

pytestmark = pytest.mark.timeout(60)


client = openai_client


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as s:
        yield s


async def test_echo_with_logprobs_covers_the_prompt(server: Server) -> None:
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    done = await client(server).completions.create(**body, extra_body={"prompt_logprobs": 2})
    choice = done.choices[0]
    _, tokenized = await server.post("/tokenize", {"prompt": PROMPT})
    prompt_ids = tokenized["tokens"]
    lp = choice.logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 3 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert choice.text.startswith(PROMPT) and lp.text_offset[n] == len(PROMPT)
    # the offsets index the echoed text: the tokenizer's BOS begins where the prompt does
    offsets = lp.text_offset
    assert offsets[:2] == [0, 0] and offsets == sorted(offsets)
    assert all(
        choice.text[o : o + len(t)] == t for t, o in zip(lp.tokens[1:n], offsets[1:n], strict=True)
    )
    # vLLM's field: each prompt token's own logprob, the same as echo's
    judged = choice.model_extra["prompt_logprobs"]
    assert judged[0] is None and len(judged) == n
    own = [judged[t][str(prompt_ids[t])]["logprob"] for t in range(1, n)]
    assert own == lp.token_logprobs[1:n]
    # streamed: the prompt's chunk first, then the generated tokens
    stream = await client(server).completions.create(**body, stream=True)
    tokens, values, text, chunks = [], [], "", []
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                chunks.append(c.logprobs.text_offset)
    assert text == choice.text and tokens == lp.tokens
    assert [o for c in chunks for o in c] == offsets
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


async def test_echo_with_logprobs_zero_has_no_top_logprobs_anywhere(server: Server) -> None:
    """`logprobs: 0` asks for each token's own logprob alone: no top
    logprobs, for the echoed prompt as for the generated tokens."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=0)
    lp = (await client(server).completions.create(**body)).choices[0].logprobs
    assert lp.top_logprobs is None and len(lp.token_logprobs) == len(lp.tokens) > 2
    stream = await client(server).completions.create(**body, stream=True)
    tops = [c.logprobs.top_logprobs async for chunk in stream for c in chunk.choices if c.logprobs]
    assert tops and all(t is None for t in tops)


async def test_max_tokens_zero_with_echo_scores_the_prompt_alone(server: Server) -> None:
    """OpenAI's legacy scoring call: the prompt's text and logprobs, nothing
    generated, `length` reached, no completion tokens counted."""
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, echo=True, logprobs=1)
    longer = await client(server).completions.create(**body, max_tokens=2)
    scored = await client(server).completions.create(**body, max_tokens=0)
    n = scored.usage.prompt_tokens
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.total_tokens == n
    lp, full = choice.logprobs, longer.choices[0].logprobs
    assert lp.tokens == full.tokens[:n] and len(lp.tokens) == n
    assert lp.token_logprobs[1:] == pytest.approx(full.token_logprobs[1:n], abs=1e-5)
    assert lp.text_offset == full.text_offset[:n]
    streamed = await client(server).completions.create(
        **body, max_tokens=0, stream=True, stream_options={"include_usage": True}
    )
    text, tokens, ends, usage = "", [], [], None
    async for chunk in streamed:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.text
            tokens += [] if c.logprobs is None else c.logprobs.tokens
            ends += [c.finish_reason] if c.finish_reason else []
    assert (text, tokens, ends) == (PROMPT, lp.tokens, ["length"])
    assert usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="needs echo"):
        await client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


async def test_chat_answers_vllms_prompt_logprobs(server: Server) -> None:
    done = await client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    judged = done.model_extra["prompt_logprobs"]
    assert judged[0] is None and len(judged) == done.usage.prompt_tokens
    assert all(1 <= len(alts) <= 2 for alts in judged[1:])
    assert all(set(r) == {"logprob", "decoded_token"} for a in judged[1:] for r in a.values())
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        await client(server).chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body={"prompt_logprobs": 1}
        )
