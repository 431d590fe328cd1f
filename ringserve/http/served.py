"""What the HTTP handlers serve: the conductor and the facts about the
model that requests are checked against."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ringserve.engine.conductor import Conductor
from ringserve.http.errors import ApiError
from ringserve.http.options import HttpOptions
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
    plan: dict[str, Any] | None = None

    @classmethod
    def build(
        cls,
        conductor: Conductor,
        options: HttpOptions,
        plan: dict[str, Any] | None,
        model_dir: Path | None,
    ) -> ServedModel:
        name = options.model_name or (model_dir.name if model_dir is not None else None)
        # Rank 0's stage is the first one, which holds the embedding: the
        # model's config there bounds the token ids it can take.
        vocab = conductor.vocab_size
        return cls(conductor, options, name or DEFAULT_MODEL_NAME, int(time.time()), vocab, plan)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.conductor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.conductor.scheduler.config.max_model_len

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
