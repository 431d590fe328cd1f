"""How rank 0 serves HTTP."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 4 << 20
