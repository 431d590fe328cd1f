"""Errors of the HTTP API, answered in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

# msgspec names the offending field as a JSON path: "... - at `$.max_tokens`".
_AT_PATH = re.compile(r" - at (?:`key` in )?`\$\.?([^`]*)`$")  # a dict key: its dict
_MISSING = re.compile(r"missing required field `([^`]+)`")


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ApiError(Exception):
    """A request the API refuses: the HTTP status and what was wrong."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            status=self.status,
            body=msgspec.json.encode(self.body()),
            content_type="application/json",
            headers={**self.headers, **(headers or {})},
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid_body(exc: msgspec.DecodeError) -> ApiError:
    """A 400 for a body that is not JSON or does not match the schema."""
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"request body is not valid JSON: {exc}", code="invalid_json")
    text = str(exc)
    match = _AT_PATH.search(text)
    param = match.group(1) if match else ""
    # msgspec's placeholder for a key or index it does not name: the field
    # that holds it is the one at fault
    param = param.split("[...]", 1)[0].rstrip(".")
    if missing := _MISSING.search(text):
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return bad_request(f"invalid request body: {text}", param=param or None)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"
