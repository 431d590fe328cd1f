"""What a user asks of one generation and what they get back."""

from __future__ import annotations

import dataclasses
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20
MAX_TOP_K = (1 << 31) - 1  # the sampler's tensors hold it; past the vocabulary it keeps all
MAX_LOGIT_BIAS = 100.0  # a bias is clamped to [-100, 100], as OpenAI and vLLM clamp it
MAX_SEED = (1 << 63) - 1  # a seed fits a signed 64-bit integer


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What a request's output must match, as vLLM names it: exactly one of
    a JSON schema (`json`, a dict or its text), `regex`, `choice` (one of
    the strings), `grammar` (Lark, or GBNF when it has `::=`) and
    `json_object` (any JSON object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        _check(
            len(given) == 1,
            "structured_outputs needs exactly one of json, regex, choice, grammar and "
            f"json_object, got {given or 'none'}",
        )
        _check(
            self.choice is None
            or (len(self.choice) > 0 and all(isinstance(c, str) for c in self.choice)),
            "structured_outputs choice must be a non-empty list of strings",
        )

    @property
    def kind(self) -> str:
        if self.json is not None:
            return "JSON schema"
        if self.json_object:
            return "JSON object"
        return (
            "regex"
            if self.regex is not None
            else "choice"
            if self.choice is not None
            else "grammar"
        )

    def key(self) -> str:
        """One spelling per grammar, for the cache of compiled grammars."""
        value: Any = self.json
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError:
                pass
        parts = [self.kind, value, self.regex, self.choice, self.grammar]
        return _json.dumps(parts, sort_keys=True, separators=(",", ":"))


# SamplingParams' fields (vLLM's) taken at their defaults only
_AT_DEFAULT_ONLY = (
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "detokenize",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters with vLLM's meanings. `temperature=0` is greedy;
    `top_k <= 0` and `top_p == 1` switch those filters off; `seed=None` lets
    rank 0 draw one (recorded, so a run can be replayed); `max_tokens=None`
    runs to the end of the context (rank 0 writes the context's length in
    its place when the request arrives). `stop`, `stop_token_ids` and
    `bad_words` may be None for none."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logits processing (engine/logits.py), in vLLM's meanings: `logit_bias`
    # maps token id to a bias; `repetition_penalty` divides the positive (and
    # multiplies the negative) logits of every token of the prompt and the
    # output; `frequency_penalty` and `presence_penalty` subtract, over the
    # output, penalty x count and penalty x (count > 0). `min_tokens` bans
    # EOS and `stop_token_ids` until that many tokens were generated;
    # `allowed_token_ids` bans every other token; a `bad_words` entry is banned
    # where the output ends with all its tokens but the last (rank 0 turns the
    # words into `bad_words_token_ids`).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    # The top `prompt_logprobs` of every prompt position (and the prompt
    # token's own), as vLLM's; such a request never reuses cached prefix KV.
    prompt_logprobs: int | None = None
    # vLLM's switches that ringserve has at their defaults only: accepted
    # there (so vLLM code runs unchanged), refused by name otherwise.
    best_of: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True

    def __post_init__(self) -> None:
        """Every field checked for its type and range (a ValueError that
        begins with the field's name); lists become tuples, a lone stop
        string or bad word a tuple of one, `top_k <= 0` is -1, a dict of
        structured outputs their params."""
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, low=1)
        _number("temperature", self.temperature, low=0)
        _int("top_k", self.top_k, high=MAX_TOP_K)
        if self.top_k <= 0:
            object.__setattr__(self, "top_k", -1)
        _number("top_p", self.top_p, high=1)
        _check(self.top_p > 0, "top_p must be in (0, 1]")
        _number("min_p", self.min_p, low=0, high=1)
        if self.seed is not None:
            _int("seed", self.seed, low=0, high=MAX_SEED)
        self._tuple("stop_token_ids", lambda t: is_int(t) and t >= 0, "token ids >= 0")
        self._tuple("stop", lambda s: isinstance(s, str) and s != "", "non-empty strings", one=str)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos must be true or false")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), low=0, high=MAX_TOP_LOGPROBS)
        self._check_logits_processing()
        _check(
            self.best_of is None or self.best_of == self.n,
            f"best_of must equal n ({self.n}): only the n choices are made, got {self.best_of!r}",
        )
        for name in _AT_DEFAULT_ONLY:
            value, default = getattr(self, name), SamplingParams.__dataclass_fields__[name].default
            _check(value is default, f"{name} is supported only as {default}, got {value!r}")

    def clone(self) -> SamplingParams:
        """A copy, as vLLM's `clone` (the params are frozen: change a copy
        with `dataclasses.replace`)."""
        return dataclasses.replace(self)

    def _check_logits_processing(self) -> None:
        _number("presence_penalty", self.presence_penalty, low=-2, high=2)
        _number("frequency_penalty", self.frequency_penalty, low=-2, high=2)
        _number("repetition_penalty", self.repetition_penalty)
        _check(self.repetition_penalty > 0, "repetition_penalty must be > 0")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias must map token ids to biases")
            _check(
                all(is_int(t) and t >= 0 for t in self.logit_bias),
                "logit_bias keys must be token ids >= 0",
            )
            for bias in self.logit_bias.values():
                _number("logit_bias", bias)
            clamped = {
                int(t): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b)))
                for t, b in self.logit_bias.items()
            }
            object.__setattr__(self, "logit_bias", clamped)
        _int("min_tokens", self.min_tokens, low=0)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens must be at most max_tokens",
        )
        if self.allowed_token_ids is not None:
            self._tuple("allowed_token_ids", lambda t: is_int(t) and t >= 0, "token ids >= 0")
            _check(
                len(self.allowed_token_ids) > 0,
                "allowed_token_ids must be a non-empty list of token ids >= 0",
            )
        self._tuple(
            "bad_words", lambda w: isinstance(w, str) and w != "", "non-empty strings", one=str
        )
        if isinstance(self.bad_words_token_ids, list):
            ids = tuple(tuple(w) for w in self.bad_words_token_ids)
            object.__setattr__(self, "bad_words_token_ids", ids)
        _int("n", self.n, low=1)
        if isinstance(self.structured_outputs, dict):
            try:
                so = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
            object.__setattr__(self, "structured_outputs", so)
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be StructuredOutputsParams or a dict of its fields",
        )

    def _tuple(self, name: str, valid: Any, what: str, one: type | None = None) -> None:
        """The field as a tuple (`one`: a lone value of that type is a tuple
        of one), each item valid."""
        value = getattr(self, name)
        if value is None:
            value = ()
        if one is not None and isinstance(value, one):
            value = (value,)
        _check(isinstance(value, list | tuple), f"{name} must be a list of {what}")
        _check(all(valid(v) for v in value), f"{name} must be a list of {what}")
        object.__setattr__(self, name, tuple(value))

    @property
    def penalized(self) -> bool:
        """Whether the last rank must change this request's logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def ending_ids(self, eos_ids: frozenset[int]) -> frozenset[int]:
        """The ids that end this request: its stop ids, and the model's ends
        of sequence (`eos_ids`) unless it ignores them; `min_tokens` bans them."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_ids)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def is_int(value: object) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _bounds(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    return f" >= {low}" if low is not None else f" <= {high}" if high is not None else ""


def _int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    ok = is_int(value)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)  # type: ignore[operator]
    _check(ok, f"{name} must be an integer{_bounds(low, high)}, got {value!r}")


def _number(name: str, value: object, low: float | None = None, high: float | None = None) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)  # type: ignore[operator]
    _check(ok, f"{name} must be a finite number{_bounds(low, high)}, got {value!r}")


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a prompt, as vLLM returns it: generated ids, their text
    (when the model has a tokenizer), the sampled tokens' logprobs when asked
    (`top_logprobs`: the k most likely per position), why generation
    stopped (`stop`, `length`, `abort` or `error: ...`) and, as vLLM's
    `stop_reason`, the stop string or stop token id that stopped it (None
    for any other end, an EOS token's included)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(self.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt: `outputs` holds its `n` choices, as vLLM's
    RequestOutput does. The first choice's fields are also the output's own
    (`token_ids`, `text`, ...), for the common case of one choice."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cached_tokens: int = 0
    stop_reason: str | int | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None
    # vLLM's shape: None for the first prompt token, then per token a dict
    # token id -> logprob (the token's own and the top ones at its position).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @classmethod
    def of_choices(cls, prompt: str | None, choices: list[RequestOutput]) -> RequestOutput:
        """One prompt's output from the outputs of its choices, in order."""
        first = choices[0]
        outputs = [
            CompletionOutput(
                i, c.text, c.token_ids, c.finish_reason, c.logprobs, c.top_logprobs, c.stop_reason
            )
            for i, c in enumerate(choices)
        ]
        return cls(
            request_id=first.request_id,
            prompt_token_ids=first.prompt_token_ids,
            token_ids=first.token_ids,
            text=first.text,
            finish_reason=first.finish_reason,
            stop_reason=first.stop_reason,
            logprobs=first.logprobs,
            top_logprobs=first.top_logprobs,
            cached_tokens=first.cached_tokens,
            outputs=outputs,
            prompt=prompt,
            prompt_logprobs=first.prompt_logprobs,
        )
