"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt
(or a conversation, rendered with the chat template) to token ids, and
token ids back to text."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from ringserve.http.errors import bad_request
from ringserve.http.prompts import chat_prompt, checked_ids, encode_text
from ringserve.http.responses import json_response
from ringserve.http.schemas import ChatMessage, PromptId, Tool, read_json
from ringserve.http.served import SERVED
from ringserve.http.tools import tool_functions


class TokenizeRequest(Struct, kw_only=True):
    """Exactly one of `prompt` and `messages`; `tools` and
    `chat_template_kwargs` go to the chat template with `messages`, as a
    chat completion's do, so the count is that of its prompt."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


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
        ids = chat_prompt(served, body.messages, body.add_generation_prompt, _template(body))
    elif body.tools is not None or body.chat_template_kwargs is not None:
        name = "tools" if body.tools is not None else "chat_template_kwargs"
        raise bad_request(f"{name} go to the chat template: send messages", param=name)
    elif body.add_special_tokens:
        ids = encode_text(served, body.prompt, "prompt")
    else:
        ids = encode_text(served, body.prompt, "prompt", add_special_tokens=False)
    return json_response(
        TokenizeResponse(count=len(ids), max_model_len=served.max_model_len, tokens=ids)
    )


def _template(body: TokenizeRequest) -> dict[str, Any]:
    """The chat template's variables, as a chat completion gives them."""
    template: dict[str, Any] = {}
    if body.tools:
        tools = msgspec.to_builtins(body.tools)
        tool_functions(tools)  # each must be a named function
        template["tools"] = tools
    return template | (body.chat_template_kwargs or {})


async def detokenize(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    body = await read_json(request, DetokenizeRequest)
    served.check_model(body.model)
    ids = checked_ids(served, body.tokens, "tokens")
    if served.tokenizer is None:
        raise bad_request("this model has no tokenizer", param="tokens")
    # special tokens kept, as vLLM's (Hugging Face's decode by default): the
    # text of /tokenize's ids, BOS and chat markers included
    text = served.tokenizer.decode(ids, skip_special_tokens=False)
    return json_response(DetokenizeResponse(prompt=text))
