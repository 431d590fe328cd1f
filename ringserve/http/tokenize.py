"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt
(or a conversation, rendered with the chat template) to token ids, and
token ids back to text."""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from msgspec import Meta, Struct

from ringserve.http.errors import bad_request
from ringserve.http.prompts import chat_prompt, checked_ids, encode_text
from ringserve.http.responses import json_response
from ringserve.http.schemas import ChatMessage, PromptId, read_json
from ringserve.http.served import SERVED


class TokenizeRequest(Struct, kw_only=True):
    """Exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[PromptId]


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


async def tokenize(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    body = await read_json(request, TokenizeRequest)
    served.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        ids = chat_prompt(served, body.messages, body.add_generation_prompt)
    elif body.add_special_tokens:
        ids = encode_text(served, body.prompt, "prompt")
    else:
        ids = encode_text(served, body.prompt, "prompt", add_special_tokens=False)
    return json_response(
        TokenizeResponse(count=len(ids), max_model_len=served.max_model_len, tokens=ids)
    )


async def detokenize(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    body = await read_json(request, DetokenizeRequest)
    served.check_model(body.model)
    ids = checked_ids(served, body.tokens, "tokens")
    if served.tokenizer is None:
        raise bad_request("this model has no tokenizer", param="tokens")
    return json_response(DetokenizeResponse(prompt=served.tokenizer.decode(ids)))
