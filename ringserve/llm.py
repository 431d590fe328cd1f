"""The offline API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ringserve import logs
from ringserve.config import EngineConfig, speculative_options
from ringserve.launch.local_ring import LocalRing
from ringserve.models.builtin import builtin_model_dir
from ringserve.params import RequestOutput, SamplingParams
from ringserve.plan.sizing import size_ring

Prompt = str | Sequence[int]


class LLM:
    """Generate from a model served on one rank or, with `pp_size > 1`, on a
    ring of local rank processes. Use as a context manager, or call close()."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        pp_size: int = 1,
        dtype: str = "float32",
        rank_memory_mib: list[int] | None = None,
        layer_split: list[int] | None = None,
        log_dir: str | None = None,
        speculative_config: dict[str, Any] | None = None,
        **engine_options: Any,
    ) -> None:
        model_dir = Path(model) if model is not None else builtin_model_dir()
        if pp_size < 1:
            raise ValueError("pp_size must be >= 1")
        split = tuple(layer_split) if layer_split is not None else None
        if speculative_config is not None:  # vLLM's form of the speculative options
            engine_options = {**engine_options, **speculative_options(speculative_config)}
        if engine_options.get("draft_model") is not None:
            engine_options["draft_model"] = Path(engine_options["draft_model"])
        config = EngineConfig(model_dir=model_dir, dtype=dtype, layer_split=split, **engine_options)
        self.config, self.plan = size_ring(config, pp_size, rank_memory_mib)
        self.pp_size = pp_size
        self._ring: LocalRing | None = None
        # Rank 0 runs in this process: log it like the child ranks, into
        # `log_dir/rank0.jsonl` when given, until close().
        self._logs = logs.LogScope(0, log_dir, console_level="warning")
        try:
            self._ring = LocalRing(self.config, pp_size, log_dir=log_dir)
            self.tokenizer = self._ring.conductor.tokenizer
        except BaseException:
            self._logs.close()
            raise

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. Raises RuntimeError
        naming the cause when the ring fails underneath."""
        prompts = _as_prompt_list(prompts)
        per_prompt = _per_prompt(params, len(prompts))
        ids = [self._encode(p) for p in prompts]
        if self._ring is None:
            raise RuntimeError("this LLM is closed")
        outputs = self._ring.generate(ids, per_prompt)
        if self._ring.conductor.failure is not None:
            raise RuntimeError(f"generation failed: {self._ring.conductor.failure}")
        return outputs

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._logs.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return items


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return params
