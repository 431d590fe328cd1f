"""ringserve: serve one language model split by layers across devices of
unequal size, as a pipeline ring."""

from __future__ import annotations

from typing import Any

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    # Resolved on first use, so importing one submodule does not load the engine.
    if name == "LLM":
        from ringserve.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput", "StructuredOutputsParams"):
        from ringserve import params

        return getattr(params, name)
    raise AttributeError(f"module 'ringserve' has no attribute {name!r}")
