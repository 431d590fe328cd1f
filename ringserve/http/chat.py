"""`POST /v1/chat/completions`: OpenAI's chat completions, streamed or not.
The conversation is rendered with the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web

from ringserve.http.logprobs import chat_logprobs
from ringserve.http.prompts import chat_prompt
from ringserve.http.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    json_response,
    new_id,
)
from ringserve.http.sampling import (
    chat_logprobs_param,
    chat_max_tokens,
    choice_params,
    refuse_unsupported,
)
from ringserve.http.schemas import ChatRequest, read_json
from ringserve.http.served import SERVED, ServedModel
from ringserve.http.sse import stream_events
from ringserve.http.structured import structured_params
from ringserve.http.submission import Submission
from ringserve.params import RequestOutput


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body = await read_json(request, ChatRequest)
    served.check_model(body.model)
    refuse_unsupported(body)
    prompt = chat_prompt(
        served, body.messages, body.add_generation_prompt, **(body.chat_template_kwargs or {})
    )
    max_tokens = chat_max_tokens(served, body, len(prompt))
    structured, grammar_param = structured_params(body)
    params = choice_params(body, max_tokens, chat_logprobs_param(body), structured)
    head = ChatCompletionChunk(new_id("chatcmpl"), int(time.time()), served.name, [])
    async with Submission(
        served.conductor,
        [prompt],
        params,
        request=request,
        prompt_param="messages",
        grammar_param=grammar_param,
    ) as sub:
        if body.stream:
            return await stream_events(request, _chunks(served, sub, head, body.include_usage))
        outputs = await sub.outputs()
    sub.check(outputs)
    choices = [_choice(served, i, out) for i, out in enumerate(outputs)]
    return json_response(
        ChatCompletion(head.id, head.created, head.model, choices, usage=sub.usage())
    )


def _choice(served: ServedModel, i: int, out: RequestOutput) -> ChatChoice:
    lp = None
    if out.logprobs is not None:
        lp = chat_logprobs(served.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
    return ChatChoice(i, AssistantMessage(out.text), lp, out.finish_reason, out.token_ids)


async def _chunks(
    served: ServedModel, sub: Submission, head: ChatCompletionChunk, include_usage: bool
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choices: list[ChatChunkChoice], **extra: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(head.id, head.created, head.model, choices, **extra)

    opening = ChatDelta(role="assistant", content="")
    yield chunk([ChatChunkChoice(i, opening) for i in range(len(sub.handles))])
    async for i, delta in sub.deltas():
        error = sub.failure(delta.finish_reason)
        if error is not None:
            raise error
        lp = None
        if delta.logprobs is not None:
            lp = chat_logprobs(
                served.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs
            )
        content = ChatDelta(content=delta.text or None)
        yield chunk([ChatChunkChoice(i, content, lp, delta.finish_reason, delta.token_ids)])
    if include_usage:
        yield chunk([], usage=sub.usage())
