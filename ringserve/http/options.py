"""How rank 0 serves HTTP."""

from __future__ import annotations

from dataclasses import dataclass


def http_url(host: str, port: int) -> str:
    """The URL of a server at `host:port` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True, slots=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 4 << 20
    # vLLM's --enable-auto-tool-choice and --tool-call-parser (http/tools.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
