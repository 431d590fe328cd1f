"""The offline API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ringserve import logs
from ringserve.config import EngineConfig, with_speculative_config
from ringserve.launch.local_ring import LocalRing
from ringserve.launch.progress import GenerateBar
from ringserve.models.builtin import builtin_model_dir
from ringserve.models.hub import resolve_model
from ringserve.models.tokenizer import Tokenizer
from ringserve.params import MAX_SEED, RequestOutput, SamplingParams, is_int
from ringserve.plan.sizing import check_fits_here, size_ring

Prompt = str | Sequence[int]
Conversation = list[dict[str, Any]]


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
        revision: str | None = None,
        speculative_config: dict[str, Any] | None = None,
        seed: int | None = None,
        tensor_parallel_size: int = 1,
        **engine_options: Any,
    ) -> None:
        """`model`: a model directory or a Hugging Face Hub id (at
        `revision`), resolved here once; the ranks get the local directory.
        `seed`, as vLLM's: requests without a seed of their own draw theirs
        from it, so a script's sampled outputs repeat from run to run.
        `engine_options` are `EngineConfig`'s fields (`ringserve launch`'s
        options, underscored)."""
        if not is_int(pp_size) or pp_size < 1:
            raise ValueError(f"pp_size must be an integer >= 1, got {pp_size!r}")
        if tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size must be 1: ringserve splits a model by layers (pp_size)"
            )
        if seed is not None and not (is_int(seed) and 0 <= seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
        unknown = sorted(set(engine_options) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(
                f"LLM() got unknown options {unknown}: the engine's options are "
                "EngineConfig's fields, as `ringserve launch --help` lists them"
            )
        self._seeds = None if seed is None else random.Random(seed)
        self.pp_size = pp_size
        self._ring: LocalRing | None = None
        # Rank 0 runs in this process: log it like the child ranks, into
        # `log_dir/rank0.jsonl` when given, until close(); planning included.
        self._claim = None if log_dir is None else logs.claim_log_dir(log_dir)
        self._logs = logs.LogScope(0, log_dir, console_level="warning")
        try:
            model_dir = resolve_model(model, revision) if model is not None else builtin_model_dir()
            split = tuple(layer_split) if layer_split is not None else None
            if speculative_config is not None:  # vLLM's form of the speculative options
                engine_options = with_speculative_config(engine_options, speculative_config)
            if engine_options.get("draft_model") is not None:
                engine_options["draft_model"] = Path(engine_options["draft_model"])
            config = EngineConfig(
                model_dir=model_dir, dtype=dtype, layer_split=split, **engine_options
            )
            self.config, self.plan = size_ring(config, pp_size, rank_memory_mib)
            check_fits_here(self.config, self.plan)
            self._ring = LocalRing(self.config, pp_size, log_dir=log_dir)
            self.tokenizer = self._ring.conductor.tokenizer
        except BaseException:
            self._logs.close()
            self._release_log_dir()
            raise

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (`encode`, `decode`, `apply_chat_template`),
        as vLLM's `LLM.get_tokenizer()`; ValueError for a model without one."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (tokenizer.json): give token ids")
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A prompt is a
        string, a list of token ids, or vLLM's `{"prompt": text}` or
        `{"prompt_token_ids": ids}`. `use_tqdm` shows a progress bar on
        stderr as vLLM does (or is the bar's factory, as vLLM allows).
        Raises RuntimeError naming the cause when the ring fails underneath."""
        prompts = [_prompt_form(p) for p in _as_prompt_list(prompts)]
        per_prompt = _per_prompt(sampling_params, len(prompts))
        ids = [self._encode(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._generate(ids, per_prompt, texts, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Generate the assistant's turn of one conversation (a list of
        messages) or of each of several, rendered with the model's chat
        template; `tools` (OpenAI's function list) and `chat_template_kwargs`
        reach the template as Hugging Face passes them. vLLM's
        `continue_final_message` and `chat_template` are taken at their
        defaults only (False, None), as the HTTP API takes them."""
        if continue_final_message is not False:
            raise ValueError("continue_final_message is supported only as False")
        if chat_template is not None:
            raise ValueError("chat_template is supported only as None: the model's own is used")
        conversations = _as_conversations(messages)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: LLM.chat needs its chat template")
        extra: dict[str, Any] = {} if tools is None else {"tools": tools}
        extra |= chat_template_kwargs or {}
        texts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt, extra)
            for c in conversations
        ]
        # The template writes the special tokens itself.
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self._generate(ids, _per_prompt(sampling_params, len(ids)), texts, use_tqdm)

    def _generate(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        texts: list[str | None],
        use_tqdm: bool | Callable[..., Any],
    ) -> list[RequestOutput]:
        """Each prompt's `n` choices run as requests of their own (choice i
        of a seeded prompt with seed + i) and come back as one output."""
        if self._ring is None:
            raise RuntimeError("this LLM is closed")
        flat_ids = [p for p, sp in zip(ids, params, strict=True) for _ in range(sp.n)]
        if self._seeds is not None:  # drawn in prompt order: the same script, the same seeds
            draw = self._seeds.getrandbits
            params = [
                sp if sp.seed is not None else dataclasses.replace(sp, seed=draw(62))
                for sp in params
            ]
        flat_params = [c for sp in params for c in _choices(sp)]
        bar = GenerateBar([sp.n for sp in params], use_tqdm)
        try:
            outputs = self._ring.generate(flat_ids, flat_params, bar.done)
        finally:
            bar.close()
        if self._ring.conductor.failure is not None:
            raise RuntimeError(f"generation failed: {self._ring.conductor.failure}")
        grouped, at = [], 0
        for sp, text in zip(params, texts, strict=True):
            grouped.append(RequestOutput.of_choices(text, outputs[at : at + sp.n]))
            at += sp.n
        return grouped

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def close(self) -> None:
        ring, self._ring = self._ring, None
        try:
            if ring is not None:
                ring.close()
        finally:  # interrupted or not, the caller's logging is put back
            self._logs.close()
            self._release_log_dir()

    def _release_log_dir(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Any]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes | bytearray):
        raise TypeError(f"prompts must be a prompt or a list of them, not {type(prompts).__name__}")
    items = list(prompts)
    if items and all(is_int(t) for t in items):
        return [items]
    return items


def _prompt_form(prompt: Any) -> Prompt:
    """A string or a list of token ids, from any form `generate` takes."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"}:
            prompt = prompt["prompt"]
        elif keys == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
        else:
            raise ValueError(
                "a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids', "
                f"not {sorted(keys)}"
            )
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        bad = next((t for t in prompt if not is_int(t)), None)
        if bad is None:
            return list(prompt)
        raise TypeError(f"prompt token ids must be integers, got {bad!r}")
    raise TypeError(
        "a prompt is a string, a list of token ids, or a dict with 'prompt' or "
        f"'prompt_token_ids', not {type(prompt).__name__}"
    )


def _as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    items = list(messages)
    if not items:
        raise ValueError("LLM.chat needs at least one message")
    if all(isinstance(m, dict) for m in items):
        return [items]  # type: ignore[list-item]
    if all(isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in items):
        return items  # type: ignore[return-value]
    raise ValueError("messages must be a list of message dicts or a list of such lists")


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """The `n` requests of one prompt; choice i of a seeded one uses seed + i
    (as the HTTP API does; past MAX_SEED it wraps to 0), so the choices
    differ and replay alike."""
    if params.n == 1:
        return [params]
    seed = params.seed
    return [
        dataclasses.replace(
            params, n=1, best_of=None, seed=None if seed is None else (seed + i) & MAX_SEED
        )
        for i in range(params.n)
    ]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Sequence):
        raise TypeError(
            f"sampling_params must be SamplingParams or a list, not {type(params).__name__}"
        )
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params must be SamplingParams, not {type(bad).__name__}")
    return params
