"""Response bodies of the HTTP API, in OpenAI's shapes, as msgspec Structs.
The async client decodes into the same Structs, so there is one definition
of each. Each choice also carries `token_ids` (an extension)."""

from __future__ import annotations

import uuid
from typing import Annotated

import msgspec
from aiohttp import web
from msgspec import Meta, Struct


def json_response(body: Struct, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(body), content_type="application/json"
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    """With `echo`, the prompt's tokens come first; its first token has no
    logprob (null, as OpenAI's)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's record of one token at one prompt position."""

    logprob: float
    decoded_token: str


# vLLM's `prompt_logprobs`: null for the first token, then per token a map
# from token id (as a string) to its record.
PromptLogprobsBody = list[dict[str, PromptLogprob] | None]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsBody | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it


class Completion(Struct):
    """A completion, or (in a stream) one chunk of it."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def token_ids(self) -> list[int] | None:
        return self.choices[0].token_ids


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(Struct, omit_defaults=True):
    """The assistant's turn; `tool_calls` only when it called tools."""

    content: str | None
    role: str
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    stop_reason: str | int | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    object: str = "chat.completion"
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobsBody | None = None

    @property
    def text(self) -> str:
        return self.choices[0].message.content or ""

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def token_ids(self) -> list[int] | None:
        return self.choices[0].token_ids


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A streamed tool call, as OpenAI streams it: the first delta of a
    call has its id, type and name, later ones extend its arguments."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class Generation(Struct):
    """`/generate`'s answer: the generated ids and their text."""

    output_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None


class GenerationChunk(Struct, omit_defaults=True):
    """One event of a streamed `/generate`; the last carries the finish
    reason and the prompt's token counts."""

    text: str
    output_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "ringserve"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class Health(Struct, omit_defaults=True):
    status: str
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class PlanFigure(Struct):
    """Bytes, and where the figure came from (plan/ledger.py SOURCES)."""

    bytes: int
    source: str


class DraftPlan(Struct):
    """Rank 0's draft model (`--speculative draft`): its total and parts."""

    bytes: int
    source: str
    weights: PlanFigure
    kv: PlanFigure
    activations: PlanFigure


class RankPlan(Struct, omit_defaults=True):
    rank: int
    layers: Annotated[list[int], Meta(min_length=2, max_length=2)]  # [start, stop)
    budget: PlanFigure
    weights: PlanFigure
    kv: PlanFigure
    activations: PlanFigure
    headroom: int
    speed: float
    stage_time: float
    host_kv: PlanFigure | None = None  # the host KV tier (--host-kv-tokens), outside the budget
    draft: DraftPlan | None = None


class PlanTotals(Struct, omit_defaults=True):
    budget: int
    weights: int
    kv: int
    activations: int
    draft: int | None = None


class MemoryPlan(Struct, omit_defaults=True):
    """`/v1/plan`: the solved memory plan (plan/ledger.py `Plan.to_dict`)."""

    layer_split: list[int]
    capacity_tokens: int
    page_size: int
    plan_for: str
    bottleneck: int
    ranks: list[RankPlan]
    totals: PlanTotals
    host_tokens: int | None = None  # the host tier's slots on every rank, when it has one
