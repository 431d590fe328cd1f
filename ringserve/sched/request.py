"""Rank 0's record of one request: its tokens, where their KV lives, and
what it owns. Pure Python over ints."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

from ringserve.params import SamplingParams
from ringserve.ring.messages import SamplingSpec


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """Invariant: `row` holds the KV slots of `tokens[:len(row)]`, in order.
    `borrowed` of them are the radix cache's (locked through `node`); every
    slot in `private` is this request's own and is freed when it leaves.
    Slots the cache adopted are in `row` but in neither set's care."""

    req_id: int
    prompt: list[int]
    params: SamplingParams
    spec: SamplingSpec
    eos_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    row: list[int] = field(default_factory=list)
    node: Any = None
    private: set[int] = field(default_factory=set)
    cached_tokens: int = 0  # prompt tokens its first admission found computed
    admitted: bool = False  # once: a re-admission reuses what it computed itself
    in_flight: bool = False
    retries: int = 0
    solo: bool = False  # rode in a voided pass: runs alone until a pass of it succeeds
    finish_reason: str | None = None
    abort_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_range(self, start: int, stop: int) -> list[int]:
        """`tokens[start:stop]` for 0 <= start <= stop, without copying the
        whole context first (a decode step takes one token of hundreds)."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.output[start - n : stop - n]
        return self.prompt[start:] + self.output[: stop - n]

    @property
    def pending(self) -> int:
        """Tokens still to be fed through the model before the next sample."""
        return len(self.prompt) + len(self.output) - len(self.row)

    @property
    def prefilling(self) -> bool:
        return len(self.row) < len(self.prompt)

    def stop_reason(self, max_model_len: int) -> str | None:
        """Why the request must stop after its newest token, if it must."""
        last = self.output[-1]
        if not self.params.ignore_eos and last in self.eos_ids:
            return "stop"
        if last in self.params.stop_token_ids:
            return "stop"
        if len(self.output) >= self.params.max_tokens:
            return "length"
        if len(self.prompt) + len(self.output) >= max_model_len:
            return "length"
        return None


def sampling_spec(
    params: SamplingParams,
    prompt_len: int = 0,
    eos_ids: frozenset[int] = frozenset(),
    prompt: list[int] | None = None,
) -> SamplingSpec:
    """The last rank's view of a request's sampling; rank 0 fixes the seed."""
    return SamplingSpec(
        temperature=0.0 if params.greedy else params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=params.seed if params.seed is not None else secrets.randbits(62),
        logprobs=params.logprobs,
        **_processing(params, prompt_len, eos_ids),
        **_prompt(params, prompt),
    )


def _prompt(params: SamplingParams, prompt: list[int] | None) -> dict:
    """The prompt-logprobs fields of the spec, off the wire when not asked."""
    if params.prompt_logprobs is None:
        return {}
    if prompt is None:
        raise ValueError("prompt_logprobs needs the prompt's tokens")
    return {"prompt_logprobs": params.prompt_logprobs, "prompt_token_ids": list(prompt)}


def _processing(params: SamplingParams, prompt_len: int, eos_ids: frozenset[int]) -> dict:
    """The logits-processing fields of the spec, left at their defaults
    (so off the wire) when the request asks for none."""
    if not params.penalized:
        return {}
    banned = params.ending_ids(eos_ids)
    bias = params.logit_bias
    allowed = params.allowed_token_ids
    return {
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": sorted(bias.items()) if bias else None,
        "min_tokens": params.min_tokens,
        "min_tokens_banned": sorted(banned) if params.min_tokens and banned else None,
        "allowed_token_ids": sorted(set(allowed)) if allowed is not None else None,
        "bad_words": [list(w) for w in params.bad_words_token_ids] or None,
        "prompt_len": prompt_len,
    }


class RequestFactory:
    """Numbers requests and binds them to the model's EOS ids."""

    def __init__(self, eos_ids: frozenset[int]) -> None:
        self.eos_ids = eos_ids
        self.next_id = 0

    def __call__(self, prompt: list[int], params: SamplingParams) -> Request:
        spec = sampling_spec(params, len(prompt), self.eos_ids, prompt)
        req = Request(self.next_id, list(prompt), params, spec, self.eos_ids)
        self.next_id += 1
        return req
