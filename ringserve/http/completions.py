"""`POST /v1/completions`: OpenAI's text completions, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web

from ringserve.http.errors import bad_request
from ringserve.http.logprobs import completion_logprobs
from ringserve.http.prompts import PromptBody, completion_prompts
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
from ringserve.http.structured import structured_params
from ringserve.http.submission import Submission
from ringserve.params import RequestOutput


async def create_completion(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body = await read_json(request, CompletionRequest)
    served.check_model(body.model)
    prompts = completion_prompts(served, body.prompt)
    refuse_unsupported(body, len(prompts))
    structured, grammar_param = structured_params(body)
    params = choice_params(body, completion_max_tokens(served, body), body.logprobs, structured)
    # With `echo`, each choice's text begins with its prompt's.
    echo = _prompt_texts(served, body.prompt, prompts) if body.echo else None
    per_choice = None if echo is None else [e for e in echo for _ in params]
    head = Completion(new_id("cmpl"), int(time.time()), served.name, [])
    async with Submission(
        served.conductor, prompts, params, request=request, grammar_param=grammar_param
    ) as sub:
        if body.stream:
            chunks = _chunks(served, sub, head, body.include_usage, per_choice)
            return await stream_events(request, chunks)
        outputs = await sub.outputs()
    sub.check(outputs)
    choices = [
        _choice(served, i, out, "" if per_choice is None else per_choice[i])
        for i, out in enumerate(outputs)
    ]
    return json_response(Completion(head.id, head.created, head.model, choices, usage=sub.usage()))


def _prompt_texts(served: ServedModel, prompt: PromptBody, ids: list[list[int]]) -> list[str]:
    """The text of each prompt: as sent, or decoded from its token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return [str(p) for p in prompt]
    if served.tokenizer is None:
        raise bad_request("echo needs a tokenizer to write the prompt's text", param="echo")
    return [served.tokenizer.decode(p, skip_special_tokens=False) for p in ids]


def _choice(served: ServedModel, i: int, out: RequestOutput, echo: str) -> CompletionChoice:
    lp = None
    if out.logprobs is not None:
        lp = completion_logprobs(served.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
    return CompletionChoice(i, echo + out.text, lp, out.finish_reason, out.token_ids)


async def _chunks(
    served: ServedModel,
    sub: Submission,
    head: Completion,
    include_usage: bool,
    echo: list[str] | None,
) -> AsyncIterator[Completion]:
    if echo is not None:  # the prompts first, as vLLM streams them
        for i, text in enumerate(echo):
            yield Completion(head.id, head.created, head.model, [CompletionChoice(i, text)])
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
