"""`POST /v1/chat/completions`: OpenAI's chat completions, streamed or not.
The conversation is rendered with the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from ringserve.http.errors import bad_request
from ringserve.http.logprobs import chat_logprobs
from ringserve.http.prompt_logprobs import prompt_logprobs_body
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
from ringserve.http.tools import ToolPlan, ToolStream, forced_calls, plan_tools
from ringserve.params import RequestOutput


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body = await read_json(request, ChatRequest)
    served.check_model(body.model)
    refuse_unsupported(body)
    tools = None if body.tools is None else msgspec.to_builtins(body.tools)
    choice = msgspec.to_builtins(body.tool_choice)
    plan = plan_tools(tools, choice, body.parallel_tool_calls, served.tool_parser)
    template: dict[str, Any] = {} if plan.tools is None else {"tools": plan.tools}
    template |= body.chat_template_kwargs or {}  # the request's own win, as in vLLM
    prompt = chat_prompt(served, body.messages, body.add_generation_prompt, template)
    max_tokens = chat_max_tokens(served, body, len(prompt))
    structured, grammar_param = structured_params(body)
    if plan.grammar is not None:
        if structured is not None:
            raise bad_request(
                f"tool_choice {plan.mode} constrains the answer already: drop {grammar_param}",
                param=grammar_param,
            )
        structured, grammar_param = plan.grammar, "tools"
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request(
            "prompt_logprobs is served without stream only on chat completions",
            param="prompt_logprobs",
        )
    logprobs = chat_logprobs_param(body)
    params = choice_params(body, max_tokens, logprobs, structured, body.prompt_logprobs)
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
            chunks = _chunks(served, sub, head, body.include_usage, plan)
            return await stream_events(request, chunks)
        outputs = await sub.outputs()
    sub.check(outputs)
    choices = [_choice(served, i, out, plan) for i, out in enumerate(outputs)]
    judged = prompt_logprobs_body(served.tokenizer, outputs[0].prompt_logprobs)
    return json_response(
        ChatCompletion(
            head.id, head.created, head.model, choices, usage=sub.usage(), prompt_logprobs=judged
        )
    )


def _choice(served: ServedModel, i: int, out: RequestOutput, plan: ToolPlan) -> ChatChoice:
    lp = None
    if out.logprobs is not None:
        lp = chat_logprobs(served.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
    message, finish = _message(served, out, plan)
    return ChatChoice(i, message, lp, finish, out.token_ids, out.stop_reason)


def _message(
    served: ServedModel, out: RequestOutput, plan: ToolPlan
) -> tuple[AssistantMessage, str | None]:
    """The assistant's turn: text, or the tool calls it made. OpenAI ends a
    turn of calls with `tool_calls`, but a forced (named) call with `stop`.
    A forced answer cut short (`length`) holds the calls begun, their
    arguments as far as they got, as a stream of it shows them."""
    if plan.mode in ("named", "required"):
        calls = forced_calls(plan, out.text)
        if out.finish_reason != "stop":
            return AssistantMessage(None, "assistant", calls or None), out.finish_reason
        return AssistantMessage(None, "assistant", calls), (
            "stop" if plan.mode == "named" else "tool_calls"
        )
    parser = served.tool_parser
    if plan.mode == "auto" and parser is not None:
        parsed = parser.parse(out.text)
        if parsed.calls:
            finish = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
            return AssistantMessage(parsed.content, "assistant", parsed.calls), finish
    return AssistantMessage(out.text, "assistant"), out.finish_reason


async def _chunks(
    served: ServedModel,
    sub: Submission,
    head: ChatCompletionChunk,
    include_usage: bool,
    plan: ToolPlan,
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choices: list[ChatChunkChoice], **extra: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(head.id, head.created, head.model, choices, **extra)

    opening = ChatDelta(role="assistant", content="")
    yield chunk([ChatChunkChoice(i, opening) for i in range(len(sub.handles))])
    streams = [ToolStream(plan, served.tool_parser) for _ in sub.handles]
    async for i, delta in sub.deltas():
        error = sub.failure(delta.finish_reason)
        if error is not None:
            raise error
        lp = None
        if delta.logprobs is not None:
            lp = chat_logprobs(
                served.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs
            )
        parts = streams[i].push(delta.text or "")
        finish = delta.finish_reason
        if finish is not None:
            rest, finish = streams[i].finish(finish)
            parts += rest
        if not parts:
            parts = [ChatDelta()]
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            # the tokens, logprobs and finish reason ride on the last chunk of the delta
            yield chunk(
                [
                    ChatChunkChoice(
                        i,
                        part,
                        lp if last else None,
                        finish if last else None,
                        delta.token_ids if last else None,
                        delta.stop_reason if last else None,
                    )
                ]
            )
    if include_usage:
        yield chunk([], usage=sub.usage())
