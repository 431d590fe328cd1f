"""What wraps every handler: OpenAI-shaped error bodies for every refusal
(aiohttp's own 404, 405 and 413 included), and the optional API key.

With a key set, every route but `/health` and `/metrics` needs
`Authorization: Bearer <key>`; those two stay open so that supervisors and
scrapers need no secret, and they reveal nothing a request could change.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from ringserve.http.errors import ApiError

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_middleware(max_body_bytes: int) -> Handler:
    """Answer every refusal as JSON; an unexpected exception is logged and
    answered 500, and the server carries on."""

    @web.middleware
    async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _from_http(request, exc, max_body_bytes).response(_kept_headers(exc))
        except ConnectionResetError:
            # the client left (mid-body, say): nobody reads an answer
            log.info("http.client_gone", method=request.method, path=request.path)
            return ApiError(
                400, "the connection closed before the request's body arrived"
            ).response()
        except Exception:
            log.exception("http.error", method=request.method, path=request.path)
            message = "internal server error; the server log has the details"
            return ApiError(500, message).response()

    return answer_errors


def auth_middleware(api_key: str | None, open_paths: frozenset[str]) -> Handler:
    """Refuse requests without the key (constant-time comparison), except
    on `open_paths`."""
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None or request.path in open_paths:
            return await handler(request)
        # aiohttp keeps a header's non-UTF-8 bytes as surrogates: compare the bytes sent
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return await handler(request)

    return check_key


def _from_http(request: web.Request, exc: web.HTTPException, max_body_bytes: int) -> ApiError:
    if exc.status == 404:
        message = f"no such route: {request.method} {request.path}"
        return ApiError(404, message, code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"method {request.method} is not allowed on {request.path} (allowed: {allowed})"
        return ApiError(405, message, code="method_not_allowed")
    if exc.status == 413:
        message = f"request body is larger than the limit of {max_body_bytes} bytes"
        return ApiError(413, message, code="request_too_large")
    return ApiError(exc.status, exc.text or exc.reason)


def _kept_headers(exc: web.HTTPException) -> dict[str, str]:
    return {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
