"""What a user asks of one generation and what they get back."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
MAX_TOP_K = (1 << 31) - 1  # the sampler's tensors hold it; past the vocabulary it keeps all


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters with vLLM's meanings. `temperature=0` is greedy;
    `top_k <= 0` and `top_p == 1` switch those filters off; `seed=None` lets
    rank 0 draw one (recorded, so a run can be replayed)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, str | list):
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            object.__setattr__(self, "stop", stop)
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be >= 1")
        _check(self.temperature >= 0, "temperature must be >= 0")
        _check(
            self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K,
            f"top_k must be -1 (off) or in [1, {MAX_TOP_K}]",
        )
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(self.seed is None or self.seed >= 0, "seed must be >= 0")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt: generated ids, their text (when the model
    has a tokenizer) and why generation stopped (`stop`, `length`, `abort`
    or `error: ...`)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cached_tokens: int = 0
