"""The offline API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ringserve.engine.core import Engine, EngineConfig
from ringserve.engine.params import RequestOutput, SamplingParams
from ringserve.engine.request import Phase, Request
from ringserve.engine.textstream import TextStream
from ringserve.models.builtin import builtin_model_dir

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
        **engine_options: Any,
    ) -> None:
        model_dir = Path(model) if model is not None else builtin_model_dir()
        if pp_size < 1:
            raise ValueError("pp_size must be >= 1")
        if pp_size > 1:
            raise NotImplementedError("pp_size > 1 needs the ring, which this build lacks")
        self.config = EngineConfig(model_dir=model_dir, dtype=dtype, **engine_options)
        self._engine: Engine | None = Engine(self.config)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        return self._engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order."""
        prompts = _as_prompt_list(prompts)
        per_prompt = _per_prompt(params, len(prompts))
        engine = self.engine
        reqs = [engine.submit(self._encode(p), sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        streams = {r.req_id: TextStream(engine.tokenizer, r.params.stop) for r in reqs}
        fed = dict.fromkeys(streams, 0)
        while any(r.phase is not Phase.FINISHED for r in reqs):
            touched = engine.step()
            if not touched and not engine.scheduler.in_flight:
                raise RuntimeError(f"engine made no progress: {engine.scheduler.census()}")
            for req in touched:
                self._feed(req, streams[req.req_id], fed)
        outputs = [self._result(r, streams[r.req_id]) for r in reqs]
        for r in reqs:
            engine.scheduler.forget(r.req_id)
        return outputs

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.engine.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _feed(self, req: Request, stream: TextStream, fed: dict[int, int]) -> None:
        for token in req.output[fed[req.req_id] :]:
            stream.push(token)
        fed[req.req_id] = len(req.output)
        if stream.stopped and req.phase is not Phase.FINISHED:
            self.engine.scheduler.abort(req.req_id, "stop")

    @staticmethod
    def _result(req: Request, stream: TextStream) -> RequestOutput:
        stream.finish()
        return RequestOutput(
            request_id=req.req_id,
            prompt_token_ids=req.prompt,
            token_ids=list(req.output),
            text=stream.text,
            finish_reason=req.finish_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            top_logprobs=list(req.top_logprobs) if req.params.logprobs else None,
            cached_tokens=req.cached_tokens,
        )

    def close(self) -> None:
        self._engine = None

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
