"""From an API request's sampling fields to the engine's SamplingParams.

`max_tokens` defaults to 16 for completions (as OpenAI's) and, for chat, to
what the context leaves after the prompt, capped at CHAT_DEFAULT_MAX_TOKENS.
A `max_tokens` above the model's context is refused; one that fits the
context but not after the prompt is served and ends with `length` where the
context does. With `n` choices and a seed, choice i is sampled with seed+i,
so the choices differ yet a request can be replayed. `top_k` 0 is off,
like -1.
"""

from __future__ import annotations

from dataclasses import fields

from ringserve.http.errors import ApiError, bad_request
from ringserve.http.schemas import (
    MAX_CHOICES,
    ChatRequest,
    CompletionRequest,
    NativeSampling,
    SamplingFields,
    unsupported_fields,
)
from ringserve.http.served import ServedModel
from ringserve.params import SamplingParams, StructuredOutputsParams

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams))
# What a refusal names when the field alone is not what is refused.
_REFUSED_AS = {
    "skip_special_tokens": "skip_special_tokens false",
    "spaces_between_special_tokens": "spaces_between_special_tokens false",
    "functions": "functions (OpenAI's deprecated form of tools; send tools)",
    "function_call": "function_call (OpenAI's deprecated form of tool_choice; send tool_choice)",
}


def refuse_unsupported(body: SamplingFields, prompts: int = 1) -> None:
    names = unsupported_fields(body)
    if names:
        what = _REFUSED_AS.get(names[0], names[0])
        raise bad_request(f"{what} is not supported by this server", param=names[0])
    if prompts * body.n > MAX_CHOICES:
        raise bad_request(
            f"{prompts} prompts with n={body.n} make {prompts * body.n} choices; "
            f"at most {MAX_CHOICES} per request",
            param="n",
        )


def completion_max_tokens(
    served: ServedModel, body: CompletionRequest, prompt_lens: list[int]
) -> int:
    """The asked max_tokens, refused when the longest prompt and it outgrow
    the context (as OpenAI refuses them); without it OpenAI's 16."""
    if body.max_tokens is not None:
        return bounded_max_tokens(served, body.max_tokens, "max_tokens", max(prompt_lens))
    return bounded_max_tokens(served, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")


def chat_max_tokens(served: ServedModel, body: ChatRequest, prompt_len: int) -> int:
    if body.max_completion_tokens is not None:
        return bounded_max_tokens(
            served, body.max_completion_tokens, "max_completion_tokens", prompt_len
        )
    if body.max_tokens is not None:
        return bounded_max_tokens(served, body.max_tokens, "max_tokens", prompt_len)
    return max(1, min(CHAT_DEFAULT_MAX_TOKENS, served.max_model_len - prompt_len))


def chat_logprobs_param(body: ChatRequest) -> int | None:
    """OpenAI's chat form (`logprobs: bool`, `top_logprobs: int`) as the
    engine's one number: None for none, k for the sampled token and k more."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


def choice_params(
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    structured: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice; a 400 naming the field when invalid."""
    stop = body.stop if body.stop is not None else ()
    logit_bias = _logit_bias(body.logit_bias)
    allowed = None if body.allowed_token_ids is None else tuple(body.allowed_token_ids)
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_k=_top_k(body.top_k),
                top_p=body.top_p,
                min_p=body.min_p,
                seed=None if body.seed is None else body.seed + i,
                stop_token_ids=() if body.stop_token_ids is None else tuple(body.stop_token_ids),
                stop=stop,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=logit_bias,
                min_tokens=body.min_tokens,
                allowed_token_ids=allowed,
                bad_words=() if body.bad_words is None else tuple(body.bad_words),
                structured_outputs=structured,
                prompt_logprobs=prompt_logprobs,
            )
            for i in range(body.n)
        ]
    except ValueError as exc:
        raise invalid_params(exc) from None


def native_params(served: ServedModel, s: NativeSampling) -> SamplingParams:
    """`/generate`'s sampling_params, which use SamplingParams' own names."""
    try:
        return SamplingParams(
            max_tokens=bounded_max_tokens(served, s.max_tokens, "max_tokens"),
            temperature=s.temperature,
            top_k=_top_k(s.top_k),
            top_p=s.top_p,
            min_p=s.min_p,
            seed=s.seed,
            stop_token_ids=tuple(s.stop_token_ids),
            stop=s.stop if s.stop is not None else (),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            logit_bias=_logit_bias(s.logit_bias),
            min_tokens=s.min_tokens,
            allowed_token_ids=None if s.allowed_token_ids is None else tuple(s.allowed_token_ids),
            bad_words=() if s.bad_words is None else tuple(s.bad_words),
        )
    except ValueError as exc:
        raise invalid_params(exc) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` keys are token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        bad = next(k for k in bias if not k.strip().isdigit())
        raise bad_request(
            f"logit_bias keys must be token ids, got {bad!r}", param="logit_bias"
        ) from None


def _top_k(top_k: int) -> int:
    """0 is off, as in vLLM's API (SamplingParams says -1)."""
    return -1 if top_k == 0 else top_k


def invalid_params(exc: ValueError) -> ApiError:
    """A 400 for SamplingParams' refusal; its message begins with the field."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return bad_request(message, param=first if first in _PARAM_NAMES else None)


def bounded_max_tokens(
    served: ServedModel, max_tokens: int, param: str, prompt_len: int | None = None
) -> int:
    """`max_tokens` where it fits the context, alone and after a prompt of
    `prompt_len` (when given: a prompt that does not fit is refused apart)."""
    context = served.max_model_len
    if max_tokens > context:
        raise bad_request(
            f"{param} is {max_tokens}, more than this model's context of {context} tokens",
            param=param,
            code="context_length_exceeded",
        )
    if prompt_len is not None and prompt_len < context < prompt_len + max_tokens:
        raise bad_request(
            f"this model's context is {context} tokens; the prompt has {prompt_len} and "
            f"{param} asks {max_tokens} more: at most {context - prompt_len} fit",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens
