"""`POST /v1/completions`: OpenAI's text completions, streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from aiohttp import web

from ringserve.engine.handle import Delta
from ringserve.http.errors import bad_request
from ringserve.http.logprobs import completion_logprobs
from ringserve.http.prompt_logprobs import (
    completion_prompt_logprobs,
    echoed_logprobs,
    joined,
    prompt_logprobs_body,
)
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

Answer = TypeVar("Answer", RequestOutput, Delta)


async def create_completion(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body = await read_json(request, CompletionRequest)
    served.check_model(body.model)
    prompts = completion_prompts(served, body.prompt)
    refuse_unsupported(body, len(prompts))
    structured, grammar_param = structured_params(body)
    scoring = _scoring(body)  # run as one token whose output is dropped, as vLLM does
    max_tokens = 1 if scoring else completion_max_tokens(served, body, [len(p) for p in prompts])
    judged = completion_prompt_logprobs(body)
    params = choice_params(body, max_tokens, body.logprobs, structured, judged)
    # With `echo`, each choice's text begins with its prompt's.
    echo = _prompt_texts(served, body.prompt, prompts) if body.echo else None
    per_choice = None if echo is None else [e for e in echo for _ in params]
    head = Completion(new_id("cmpl"), int(time.time()), served.name, [])
    async with Submission(
        served.conductor, prompts, params, request=request, grammar_param=grammar_param
    ) as sub:
        if body.stream:
            chunks = _chunks(served, sub, head, body, per_choice, scoring)
            return await stream_events(request, chunks)
        outputs = await sub.outputs()
    sub.check(outputs)
    if scoring:  # the prompt alone: the one token the pass made is not part of the answer
        outputs = [_unanswered(out) for out in outputs]
    choices = [
        _choice(served, i, out, "" if per_choice is None else per_choice[i], body)
        for i, out in enumerate(outputs)
    ]
    usage = sub.usage(generated=not scoring)
    return json_response(Completion(head.id, head.created, head.model, choices, usage=usage))


def _scoring(body: CompletionRequest) -> bool:
    """`max_tokens: 0` with `echo`, OpenAI's legacy way to score a prompt:
    its text (and with `logprobs`, its tokens' logprobs) and nothing more."""
    if body.max_tokens != 0:
        return False
    if not body.echo:
        raise bad_request(
            "max_tokens 0 generates nothing: it needs echo (the prompt's text and logprobs)",
            param="max_tokens",
        )
    if body.min_tokens > 0:
        raise bad_request("min_tokens must be at most max_tokens", param="min_tokens")
    return True


def _unanswered(out: Answer) -> Answer:
    """`out` (a choice's output, or a delta of its stream) as if it had
    generated nothing: its length reached where it ended."""
    ended = None if out.finish_reason is None else "length"
    return dataclasses.replace(
        out,
        text="",
        token_ids=[],
        logprobs=None,
        top_logprobs=None,
        finish_reason=ended,
        stop_reason=None,
    )


def _prompt_texts(served: ServedModel, prompt: PromptBody, ids: list[list[int]]) -> list[str]:
    """The text of each prompt: as sent, or decoded from its token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return [str(p) for p in prompt]
    if served.tokenizer is None:
        raise bad_request("echo needs a tokenizer to write the prompt's text", param="echo")
    return [served.tokenizer.decode(p, skip_special_tokens=False) for p in ids]


def _choice(
    served: ServedModel, i: int, out: RequestOutput, echo: str, body: CompletionRequest
) -> CompletionChoice:
    lp = None
    if out.logprobs is not None:
        lp = completion_logprobs(
            served.tokenizer, out.token_ids, out.logprobs, out.top_logprobs, len(echo)
        )
    if body.echo and body.logprobs is not None:
        lp = joined(_echoed(served, body, out, echo), lp)
    plp = prompt_logprobs_body(served.tokenizer, out.prompt_logprobs)
    wanted = plp if body.prompt_logprobs is not None else None
    return CompletionChoice(
        i, echo + out.text, lp, out.finish_reason, out.token_ids, wanted, out.stop_reason
    )


def _echoed(
    served: ServedModel, body: CompletionRequest, out: RequestOutput, echo: str
) -> CompletionLogprobs:
    if out.prompt_logprobs is None or body.logprobs is None:
        raise ValueError("an echoed choice with logprobs has no prompt logprobs")
    return echoed_logprobs(
        served.tokenizer, out.prompt_token_ids, out.prompt_logprobs, body.logprobs, echo
    )


async def _chunks(
    served: ServedModel,
    sub: Submission,
    head: Completion,
    body: CompletionRequest,
    echo: list[str] | None,
    scoring: bool,
) -> AsyncIterator[Completion]:
    # The prompts first, as vLLM streams them; a choice that reports prompt
    # logprobs gets its prompt's chunk with its first tokens, which follow them.
    late = body.logprobs is not None or body.prompt_logprobs is not None
    if echo is not None and not late:
        for i, text in enumerate(echo):
            yield Completion(head.id, head.created, head.model, [CompletionChoice(i, text)])
    offsets = [0 if echo is None else len(e) for e in (echo or [""] * len(sub.handles))]
    pending = set(range(len(sub.handles))) if late else set()
    async for i, delta in sub.deltas():
        error = sub.failure(delta.finish_reason)
        if error is not None:
            raise error
        if scoring:
            delta = _unanswered(delta)
        if i in pending:
            pending.discard(i)
            first = _prompt_chunk(served, sub.handles[i].output(), i, echo, body)
            if first is not None:
                yield Completion(head.id, head.created, head.model, [first])
        lp: CompletionLogprobs | None = None
        if delta.logprobs is not None:
            lp = completion_logprobs(
                served.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs, offsets[i]
            )
            offsets[i] += sum(len(t) for t in lp.tokens)
        choice = CompletionChoice(
            i, delta.text, lp, delta.finish_reason, delta.token_ids, stop_reason=delta.stop_reason
        )
        yield Completion(head.id, head.created, head.model, [choice])
    if body.include_usage:
        yield Completion(head.id, head.created, head.model, [], usage=sub.usage(not scoring))


def _prompt_chunk(
    served: ServedModel,
    out: RequestOutput,
    i: int,
    echo: list[str] | None,
    body: CompletionRequest,
) -> CompletionChoice | None:
    """The chunk a choice's stream begins with: its echoed prompt (with the
    prompt's logprobs when asked) and vLLM's `prompt_logprobs` when asked."""
    if echo is None and body.prompt_logprobs is None:
        return None
    lp = None
    if echo is not None and body.logprobs is not None:
        lp = _echoed(served, body, out, echo[i])
    plp = None
    if body.prompt_logprobs is not None:
        plp = prompt_logprobs_body(served.tokenizer, out.prompt_logprobs)
    return CompletionChoice(i, "" if echo is None else echo[i], lp, None, None, plp)
