"""What the HTTP handlers serve: the conductor and the facts about the
model that requests are checked against."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from ringserve.engine.conductor import Conductor
from ringserve.http.errors import ApiError
from ringserve.http.options import HttpOptions
from ringserve.http.responses import MemoryPlan
from ringserve.http.tools import ToolParser, make_parser
from ringserve.models.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "ringserve"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model served by one conductor, under one public name."""

    conductor: Conductor
    options: HttpOptions
    name: str
    created: int
    vocab_size: int
    plan: MemoryPlan | None = None

    @classmethod
    def build(
        cls,
        conductor: Conductor,
        options: HttpOptions,
        plan: dict[str, Any] | None,
        model_dir: Path | None,
    ) -> ServedModel:
        make_parser(options.tool_call_parser)  # an unknown parser fails the start
        name = options.model_name or (model_dir.name if model_dir is not None else None)
        # Rank 0's stage is the first one, which holds the embedding: the
        # model's config there bounds the token ids it can take.
        vocab = conductor.vocab_size
        # Checked once here, so /v1/plan answers what its schema says.
        memory = None if plan is None else msgspec.convert(plan, MemoryPlan)
        return cls(conductor, options, name or DEFAULT_MODEL_NAME, int(time.time()), vocab, memory)

    @property
    def tool_parser(self) -> ToolParser | None:
        """The parser of `tool_choice: auto` answers; None unless enabled."""
        if not self.options.enable_auto_tool_choice:
            return None
        return make_parser(self.options.tool_call_parser)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.conductor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.conductor.scheduler.config.max_model_len

    @property
    def constraints(self) -> dict[str, dict[str, Any]]:
        """What requests are checked against here (check_model,
        prompts.checked_ids, sampling.bounded_max_tokens), as JSON Schema, by
        the names the request schemas give them (schemas.served)."""
        return {
            "model": {"const": self.name},
            "max_model_len": {"maximum": self.max_model_len},
            "token_id": {"maximum": self.vocab_size - 1},
        }

    def check_model(self, model: str | None) -> None:
        """A request may name the served model or no model at all."""
        if model is not None and model != self.name:
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )


SERVED = web.AppKey("served", ServedModel)
