"""`POST /v1/completions`: OpenAI's text completions, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web

from ringserve.http.logprobs import completion_logprobs
from ringserve.http.prompts import completion_prompts
from ringserve.http.responses import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    json_response,
    new_id,
)
from ringserve.http.sampling import choice_params, completion_max_tokens, refuse_unsupported
from ringserve.http.schemas import CompletionRequest, read_json
from ringserve.http.served import SERVED, ServedModel
from ringserve.http.sse import stream_events
from ringserve.http.submission import Submission
from ringserve.params import RequestOutput


async def create_completion(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body = await read_json(request, CompletionRequest)
    served.check_model(body.model)
    prompts = completion_prompts(served, body.prompt)
    refuse_unsupported(body, len(prompts))
    params = choice_params(body, completion_max_tokens(served, body), body.logprobs)
    head = Completion(new_id("cmpl"), int(time.time()), served.name, [])
    async with Submission(served.conductor, prompts, params, request=request) as sub:
        if body.stream:
            return await stream_events(request, _chunks(served, sub, head, body.include_usage))
        outputs = await sub.outputs()
    sub.check(outputs)
    choices = [_choice(served, i, out) for i, out in enumerate(outputs)]
    return json_response(Completion(head.id, head.created, head.model, choices, usage=sub.usage()))


def _choice(served: ServedModel, i: int, out: RequestOutput) -> CompletionChoice:
    lp = None
    if out.logprobs is not None:
        lp = completion_logprobs(served.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
    return CompletionChoice(i, out.text, lp, out.finish_reason, out.token_ids)


async def _chunks(
    served: ServedModel, sub: Submission, head: Completion, include_usage: bool
) -> AsyncIterator[Completion]:
    offsets = [0] * len(sub.handles)  # where each choice's next token text begins
    async for i, delta in sub.deltas():
        error = sub.failure(delta.finish_reason)
        if error is not None:
            raise error
        lp: CompletionLogprobs | None = None
        if delta.logprobs is not None:
            lp = completion_logprobs(
                served.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs, offsets[i]
            )
            offsets[i] += sum(len(t) for t in lp.tokens)
        choice = CompletionChoice(i, delta.text, lp, delta.finish_reason, delta.token_ids)
        yield Completion(head.id, head.created, head.model, [choice])
    if include_usage:
        yield Completion(head.id, head.created, head.model, [], usage=sub.usage())
