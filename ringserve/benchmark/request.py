"""One benchmark request: a streamed completion (or chat completion) over
aiohttp against any OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ringserve.benchmark.datasets import SampleRequest
from ringserve.http.sse import data_payloads

CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class RequestResult:
    """What one request did. `itl` holds the gaps between content chunks
    after the first; `output_tokens` is the server's usage count when it
    sent one, else the number of content chunks."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str = ""
    usage_prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how requests are sent."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def body(self, req: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.expected_output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == CHAT:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def send(session: aiohttp.ClientSession, target: Target, req: SampleRequest) -> RequestResult:
    """Send `req`, streaming; never raises for a failed request (the result
    says why)."""
    out = RequestResult(req.prompt_len)
    began = last = time.perf_counter()
    chunks, pieces = 0, []
    try:
        async with session.post(
            target.url, json=target.body(req), headers=target.headers()
        ) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for data in data_payloads(resp.content.iter_any()):
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))
                    return out
                text = _content(chunk, target.endpoint)
                now = time.perf_counter()
                if text:
                    if chunks == 0:
                        out.ttft = now - began
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    pieces.append(text)
                usage = chunk.get("usage")
                if usage:
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    out.usage_prompt_tokens = usage.get("prompt_tokens")
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - began
    out.text = "".join(pieces)
    if not out.output_tokens:
        out.output_tokens = chunks
    if chunks == 0:  # nothing generated (an immediate stop): the first token is the end
        out.ttft = out.latency
    out.success = True
    return out


def _content(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == CHAT:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""
