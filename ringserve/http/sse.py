"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` per
event and `data: [DONE]\\n\\n` last. An error after the stream has begun
travels as an event `{"error": {...}}` followed by [DONE], as OpenAI's
clients expect."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
import structlog
from aiohttp import web

from ringserve.http.errors import ApiError

log = structlog.get_logger(__name__)

DONE = b"data: [DONE]\n\n"


def event(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def stream_events(request: web.Request, events: AsyncIterator[object]) -> web.StreamResponse:
    """Write every event, then [DONE]. A client gone mid-stream ends it
    quietly: its requests are aborted by whoever owns them."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # a proxy in front must not buffer the stream
        }
    )
    try:
        await response.prepare(request)
        async with contextlib.aclosing(events) as items:
            async for item in items:
                await response.write(event(item))
    except ConnectionResetError:
        log.info("http.stream_cut", path=request.path)
        return response
    except ApiError as exc:
        await _end_with(response, exc)
        return response
    except Exception:
        # The status line is sent: the error can only travel as an event.
        log.exception("http.stream_error", path=request.path)
        await _end_with(response, ApiError(500, "internal server error; see the server log"))
        return response
    with contextlib.suppress(ConnectionResetError):
        await response.write(DONE)
        await response.write_eof()
    return response


async def _end_with(response: web.StreamResponse, error: ApiError) -> None:
    with contextlib.suppress(ConnectionResetError):
        await response.write(event(error.body()))
        await response.write(DONE)
        await response.write_eof()


async def data_payloads(content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The reading end: the `data:` payload of every line of a stream's
    body, however long a line is (aiohttp's own line reader gives up on a
    line longer than its buffer, and an echoed prompt's logprobs make one).
    `content` yields the body's bytes as they come (`StreamReader.iter_any()`).
    A last line cut short, with no newline, is not an event (as in the SSE spec)."""
    parts: list[bytes] = []
    async for piece in content:
        while (cut := piece.find(b"\n")) >= 0:
            parts.append(piece[:cut])
            line, parts, piece = b"".join(parts).strip(), [], piece[cut + 1 :]
            if line.startswith(b"data:"):
                yield line[len(b"data:") :].strip()
        parts.append(piece)
