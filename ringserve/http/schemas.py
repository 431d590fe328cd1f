"""Request bodies of the HTTP API as msgspec Structs: decoding a body
validates its types and bounds, and a failure names the field.

OpenAI's fields that ringserve does not implement are declared so that a
request asking for them is refused rather than silently served without
them (`unsupported_fields`); other unknown fields are ignored, as OpenAI's
clients send some (`user`, say) that change nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from ringserve.http.errors import invalid_body
from ringserve.params import MAX_TOP_LOGPROBS

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request, over all its prompts
MAX_STOP = 16

Positive = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]
Seed = Annotated[int, Meta(ge=0, lt=1 << 62)]  # room for seed + i
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Stop = str | Annotated[list[str], Meta(max_length=MAX_STOP)] | None


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """What completions and chat share. Extensions to OpenAI: `top_k`,
    `min_p`, `stop_token_ids`, `ignore_eos`."""

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields, kw_only=True):
    """`prompt`: a string, a list of strings, a list of token ids, or a
    list of lists of token ids (several prompts)."""

    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class NativeSampling(Struct, kw_only=True, forbid_unknown_fields=True):
    """`/generate`'s sampling parameters: SamplingParams' own names and
    defaults; an unknown name is an error, not ignored."""

    max_tokens: Positive = 16
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Seed | None = None
    stop_token_ids: list[TokenId] = []
    stop: Stop = None
    ignore_eos: bool = False
    logprobs: TopLogprobs | None = None


class GenerateRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of `input_ids` and `text`."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: NativeSampling = msgspec.field(default_factory=NativeSampling)
    stream: bool = False


def unsupported_fields(body: SamplingFields) -> list[str]:
    """Names of requested features ringserve does not implement."""
    asked = {
        "presence_penalty": body.presence_penalty != 0,
        "frequency_penalty": body.frequency_penalty != 0,
        "logit_bias": bool(body.logit_bias),
    }
    if isinstance(body, CompletionRequest):
        asked |= {
            "echo": body.echo,
            "suffix": body.suffix is not None,
            "best_of": body.best_of is not None and body.best_of != body.n,
        }
    if isinstance(body, ChatRequest):
        kind = (body.response_format or {}).get("type", "text")
        asked |= {"tools": bool(body.tools), "response_format": kind != "text"}
    return [name for name, on in asked.items() if on]


T = TypeVar("T")


async def read_json(request: web.Request, kind: type[T]) -> T:
    """The request's body decoded as `kind`; a 400 naming the problem
    otherwise (a 413 from aiohttp when it is over the size limit)."""
    raw = await request.read()
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise invalid_body(exc) from None
