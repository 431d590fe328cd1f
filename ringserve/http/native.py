"""`POST /generate`: the native API, token ids in and out.

`{"input_ids": [...], "sampling_params": {...}}` (or `"text"` in place of
`input_ids`), with SamplingParams' own names and defaults; answers
`{"output_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens"}`,
or with `"stream": true` a server-sent event per delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from ringserve.http.errors import bad_request
from ringserve.http.prompts import checked_ids, encode_text
from ringserve.http.responses import Generation, GenerationChunk, json_response
from ringserve.http.sampling import native_params
from ringserve.http.schemas import GenerateRequest, read_json
from ringserve.http.served import SERVED, ServedModel
from ringserve.http.sse import stream_events
from ringserve.http.submission import Submission


async def generate(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body = await read_json(request, GenerateRequest)
    prompt = _prompt(served, body)
    params = native_params(served, body.sampling_params)
    async with Submission(
        served.conductor, [prompt], [params], request=request, prompt_param="input_ids"
    ) as sub:
        if body.stream:
            return await stream_events(request, _chunks(sub))
        outputs = await sub.outputs()
    sub.check(outputs)
    out = outputs[0]
    return json_response(
        Generation(
            out.token_ids,
            out.text,
            out.finish_reason,
            len(out.prompt_token_ids),
            out.cached_tokens,
            out.logprobs,
        )
    )


def _prompt(served: ServedModel, body: GenerateRequest) -> list[int]:
    if (body.input_ids is None) == (body.text is None):
        raise bad_request("give exactly one of input_ids and text", param="input_ids")
    if body.text is not None:
        return encode_text(served, body.text, "text")
    assert body.input_ids is not None  # exactly one of the two was given
    return checked_ids(served, body.input_ids, "input_ids")


async def _chunks(sub: Submission) -> AsyncIterator[GenerationChunk]:
    async for _, delta in sub.deltas():
        error = sub.failure(delta.finish_reason)
        if error is not None:
            raise error
        chunk = GenerationChunk(delta.text, delta.token_ids, delta.logprobs, delta.finish_reason)
        if delta.finish_reason is not None:
            req = sub.handles[0].req
            chunk.prompt_tokens, chunk.cached_tokens = len(req.prompt), req.cached_tokens
        yield chunk
