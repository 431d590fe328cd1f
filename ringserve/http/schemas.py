"""Request bodies of the HTTP API as msgspec Structs: decoding a body
validates its types and bounds, and a failure names the field.

OpenAI's fields that ringserve does not implement are declared so that a
request asking for them is refused rather than silently served without
them (`unsupported_fields`); other unknown fields are ignored, as OpenAI's
clients send some (`user`, say) that change nothing.

The OpenAPI description is generated from these Structs, so it says what
decoding accepts. What decoding alone cannot check is said beside the
field, for the description, and checked by the handlers: a refusal by
`unsupported_fields` (`only(...)`), a bound that is the served model's
(`served("max_model_len")`: http/openapi.py writes the number in), and rules
across fields (`SCHEMA_RULES`).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from ringserve.http.errors import ApiError, bad_request, invalid_body
from ringserve.params import MAX_TOP_K, MAX_TOP_LOGPROBS

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request, over all its prompts
MAX_STOP = 16

SERVED_BY = "x-ringserve-served"  # marks a constraint that is the served model's


def served(name: str) -> dict[str, Any]:
    """A constraint that is the served model's `name` (ServedModel.constraints),
    written into the description when the app is built."""
    return {SERVED_BY: name}


def only(value: object) -> dict[str, Any]:
    """The one value a field not implemented here may take."""
    return {"const": value, "description": "not supported by this server"}


MaxTokens = Annotated[int, Meta(ge=1, extra_json_schema=served("max_model_len"))]
TokenId = Annotated[int, Meta(ge=0)]
PromptId = Annotated[int, Meta(ge=0, extra_json_schema=served("token_id"))]
Seed = Annotated[int, Meta(ge=0, lt=1 << 62)]  # room for seed + i
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Temperature = Annotated[float, Meta(ge=0)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1, le=MAX_TOP_K, description="-1 or 0: no top-k filter")]
MinP = Annotated[float, Meta(ge=0, le=1)]
StopText = Annotated[str, Meta(min_length=1)]
Stop = StopText | Annotated[list[StopText], Meta(max_length=MAX_STOP)] | None
Penalty = Annotated[float, Meta(ge=-2, le=2)]
BiasKey = Annotated[str, Meta(pattern="^[0-9]{1,9}$", description="a token id")]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """What completions and chat share. Extensions to OpenAI, as vLLM names
    them: `top_k`, `min_p`, `stop_token_ids`, `ignore_eos`,
    `repetition_penalty`, `min_tokens`, `allowed_token_ids`, `bad_words`.
    `logit_bias` maps token ids (as strings, JSON's keys) to biases, clamped
    to [-100, 100]."""

    model: Annotated[str, Meta(extra_json_schema=served("model"))] | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[PromptId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[BiasKey, float] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    min_tokens: Annotated[int, Meta(ge=0, description="at most max_tokens")] = 0
    allowed_token_ids: Annotated[list[PromptId], Meta(min_length=1)] | None = None
    bad_words: list[StopText] | None = None

    # Structured outputs: OpenAI's `response_format`, vLLM's
    # `structured_outputs` and its older `guided_*` spellings (http/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["guidance", "llguidance", "auto"] | None = None
    guided_whitespace_pattern: Annotated[str, Meta(extra_json_schema=only(None))] | None = None
    # vLLM's extensions that ringserve does not implement: declared, so a
    # request asking for one is refused by name (unsupported_fields).
    use_beam_search: Annotated[bool, Meta(extra_json_schema=only(False))] = False
    length_penalty: Annotated[float, Meta(extra_json_schema=only(1))] = 1.0
    include_stop_str_in_output: Annotated[bool, Meta(extra_json_schema=only(False))] = False
    skip_special_tokens: Annotated[bool, Meta(extra_json_schema=only(True))] = True
    spaces_between_special_tokens: Annotated[bool, Meta(extra_json_schema=only(True))] = True
    truncate_prompt_tokens: Annotated[int, Meta(extra_json_schema=only(None))] | None = None
    prompt_logprobs: TopLogprobs | None = None
    priority: Annotated[int, Meta(extra_json_schema=only(0))] = 0
    logits_processors: Annotated[list[Any], Meta(extra_json_schema=only(None))] | None = None
    return_tokens_as_token_ids: Annotated[bool, Meta(extra_json_schema=only(False))] = False
    cache_salt: Annotated[str, Meta(extra_json_schema=only(None))] | None = None
    kv_transfer_params: Annotated[dict[str, Any], Meta(extra_json_schema=only(None))] | None = None
    vllm_xargs: Annotated[dict[str, Any], Meta(extra_json_schema=only(None))] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields, kw_only=True):
    """`prompt`: a string, a list of strings, a list of token ids, or a
    list of lists of token ids (several prompts)."""

    prompt: str | list[str | PromptId | list[PromptId]]
    max_tokens: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="0 with echo scores the prompt: its text (and logprobs) alone",
                extra_json_schema=served("max_model_len"),
            ),
        ]
        | None
    ) = None
    logprobs: TopLogprobs | None = None
    echo: Annotated[
        bool, Meta(description="with logprobs, the logprobs cover the prompt's tokens too")
    ] = False
    suffix: Annotated[str, Meta(extra_json_schema=only(None))] | None = None
    best_of: Annotated[int, Meta(description="must equal n")] | None = None


class ContentPart(Struct, kw_only=True):
    type: Literal["text"]
    text: str | None = None


class CalledFunction(Struct, kw_only=True):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class MessageToolCall(Struct, kw_only=True):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Struct, kw_only=True):
    """The roles the chat templates served here render; OpenAI's
    `developer` is rendered as `system`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's, OpenAI's shape
    tool_call_id: str | None = None  # a tool message's


class JsonSchemaFormat(Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`: with `strict`, every object
    of the schema is closed (no properties beyond those it names)."""

    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of `json` (a schema),
    `regex`, `choice`, `grammar` (Lark, or GBNF) and `json_object`."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Annotated[str, Meta(extra_json_schema=only(None))] | None = None
    whitespace_pattern: Annotated[str, Meta(extra_json_schema=only(None))] | None = None


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Annotated[list[Any], Meta(extra_json_schema=only(None))] | None = None
    function_call: Annotated[str | dict[str, Any], Meta(extra_json_schema=only(None))] | None = None
    # vLLM's chat extensions: the template's variables, and what is refused by name.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: Annotated[bool, Meta(extra_json_schema=only(False))] = False
    chat_template: Annotated[str, Meta(extra_json_schema=only(None))] | None = None
    documents: Annotated[list[Any], Meta(extra_json_schema=only(None))] | None = None
    mm_processor_kwargs: Annotated[dict[str, Any], Meta(extra_json_schema=only(None))] | None = None
    echo: Annotated[bool, Meta(extra_json_schema=only(False))] = False


class NativeSampling(Struct, kw_only=True, forbid_unknown_fields=True):
    """`/generate`'s sampling parameters: SamplingParams' own names and
    defaults; an unknown name is an error, not ignored."""

    max_tokens: MaxTokens = 16
    temperature: Temperature = 1.0
    top_k: TopK = -1
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    seed: Seed | None = None
    stop_token_ids: list[TokenId] = []
    stop: Stop = None
    ignore_eos: bool = False
    logprobs: TopLogprobs | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    logit_bias: dict[BiasKey, float] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    bad_words: list[StopText] | None = None


class GenerateRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of `input_ids` and `text`."""

    input_ids: Annotated[list[PromptId], Meta(min_length=1)] | None = None
    text: str | None = None
    sampling_params: NativeSampling = msgspec.field(default_factory=NativeSampling)
    stream: bool = False


def _prompt_forms() -> dict[str, Any]:
    """A completion's prompt: one of four forms, never a mixture (msgspec
    decodes one list type per union; prompts.py refuses mixtures)."""
    token_id = {"type": "integer", "minimum": 0, **served("token_id")}
    ids = {"type": "array", "items": token_id, "minItems": 1}
    several = {"minItems": 1, "maxItems": MAX_CHOICES}
    return {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, **several},
            ids,
            {"type": "array", "items": ids, **several},
        ]
    }


def _best_of_is_n() -> dict[str, Any]:
    same = [{"properties": {"n": {"const": k}, "best_of": {"enum": [None, k]}}, "required": ["n"]}
            for k in range(1, MAX_N + 1)]  # fmt: skip
    unset = {"properties": {"best_of": {"enum": [None, 1]}}, "not": {"required": ["n"]}}
    return {"anyOf": [*same, unset]}


# What the fields alone cannot say, merged into each Struct's description
# (a property named here is described as written here) and checked by the
# handlers: prompts.py, sampling.py, native.py.
SCHEMA_RULES: dict[str, dict[str, Any]] = {
    "CompletionRequest": {"properties": {"prompt": _prompt_forms()}, **_best_of_is_n()},
    "ChatRequest": {
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
    },
    "TokenizeRequest": {
        "oneOf": [
            {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
            {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
        ]
    },
    "GenerateRequest": {
        "oneOf": [
            {"properties": {"input_ids": {"type": "array"}}, "required": ["input_ids"]},
            {"properties": {"text": {"type": "string"}}, "required": ["text"]},
        ]
    },
}


def unsupported_fields(body: SamplingFields) -> list[str]:
    """Names of requested features ringserve does not implement."""
    asked: dict[str, bool] = {
        "use_beam_search": body.use_beam_search,
        "length_penalty": body.length_penalty != 1,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": not body.skip_special_tokens,
        "spaces_between_special_tokens": not body.spaces_between_special_tokens,
        "truncate_prompt_tokens": body.truncate_prompt_tokens is not None,
        "priority": body.priority != 0,
        "logits_processors": body.logits_processors is not None,
        "return_tokens_as_token_ids": body.return_tokens_as_token_ids,
        "cache_salt": body.cache_salt is not None,
        "kv_transfer_params": body.kv_transfer_params is not None,
        "vllm_xargs": body.vllm_xargs is not None,
        "guided_whitespace_pattern": body.guided_whitespace_pattern is not None,
    }
    so = body.structured_outputs
    if so is not None:
        asked |= {
            "structured_outputs.structural_tag": so.structural_tag is not None,
            "structured_outputs.whitespace_pattern": so.whitespace_pattern is not None,
        }
    if isinstance(body, CompletionRequest):
        asked |= {
            "suffix": body.suffix is not None,
            "best_of": body.best_of is not None and body.best_of != body.n,
        }
    if isinstance(body, ChatRequest):
        asked |= {
            "functions": body.functions is not None,
            "function_call": body.function_call is not None,
            "continue_final_message": body.continue_final_message,
            "chat_template": body.chat_template is not None,
            "documents": body.documents is not None,
            "mm_processor_kwargs": body.mm_processor_kwargs is not None,
            "echo": body.echo,
        }
    return [name for name, on in asked.items() if on]


T = TypeVar("T")


async def read_json(request: web.Request, kind: type[T]) -> T:
    """The request's body decoded as `kind`; a 400 naming the problem
    otherwise (a 413 from aiohttp when it is over the size limit)."""
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:  # a Content-Encoding its bytes are not in
        reason = exc.__cause__ if exc.__cause__ is not None else exc
        message = getattr(reason, "message", None) or str(reason)
        raise bad_request(
            f"the request body cannot be read: {message}", code="invalid_body"
        ) from None
    try:
        decoded = msgspec.json.decode(raw)
    except msgspec.ValidationError as exc:
        raise _out_of_range(raw) or invalid_body(exc) from None
    except msgspec.DecodeError as exc:
        raise invalid_body(exc) from None
    except UnicodeDecodeError as exc:  # msgspec checks strings' UTF-8 apart
        raise invalid_body(msgspec.DecodeError(f"it is not UTF-8 ({exc.reason})")) from None
    except RecursionError:
        raise _too_deep() from None
    try:
        return msgspec.convert(_whole_numbers(_unset_nulls(decoded)), kind)
    except msgspec.DecodeError as exc:
        raise invalid_body(exc) from None


def _out_of_range(raw: bytes) -> ApiError | None:
    """A 400 naming the field of a number past a float's range (1e400), which
    msgspec's untyped decoding cannot name; None when there is none."""
    try:
        found = _infinite_at(json.loads(raw), "")
    except (ValueError, RecursionError):
        return None
    if found is None:
        return None
    return bad_request(f"invalid request body: a number out of range at `{found}`", param=found)


def _infinite_at(value: Any, path: str) -> str | None:
    if isinstance(value, float) and math.isinf(value):
        return path or "$"
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        at = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
        if (found := _infinite_at(item, at.lstrip("."))) is not None:
            return found
    return None


# How deep a body's arrays and objects may nest: a JSON schema of a real
# tool or answer is a few tens of levels; every walk of the body (here and
# in the grammar backends) recurses.
MAX_NESTING = 128


def _too_deep() -> ApiError:
    return bad_request(
        f"request body nests arrays and objects deeper than {MAX_NESTING} levels",
        code="invalid_json",
    )


def _unset_nulls(body: Any) -> Any:
    """The body without its top-level fields that are null: OpenAI's
    optional fields are nullable and a null one takes its default (the
    official clients send `null` for a parameter given as None)."""
    if isinstance(body, dict):
        return {k: v for k, v in body.items() if v is not None}
    return body


def _whole_numbers(value: Any, depth: int = 0) -> Any:
    """`value` with every float that has no fraction as an int: JSON Schema's
    integer is any such number (`2.0` too), and msgspec's int is not. A 400
    past MAX_NESTING levels."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, (list, dict)) and depth >= MAX_NESTING:
        raise _too_deep()
    if isinstance(value, list):
        return [_whole_numbers(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _whole_numbers(v, depth + 1) for k, v in value.items()}
    return value
