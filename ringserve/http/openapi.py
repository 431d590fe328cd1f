"""The API's OpenAPI 3.1 description, built from the same route table that
the app registers, with the body schemas generated from the msgspec
Structs that decode and encode them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from ringserve.http.errors import ErrorBody

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REF = "#/components/schemas/{name}"
OPENAPI = web.AppKey("openapi", dict)


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint. `answer` is the JSON body of a 200 (None: `media` text);
    `streams` means `stream: true` turns the answer into server-sent events;
    `open` routes need no API key."""

    method: str
    path: str
    handler: Handler
    summary: str
    body: type | None = None
    answer: type | None = None
    media: str = "application/json"
    streams: bool = False
    open: bool = False


def openapi_spec(routes: Sequence[Route], version: str, secured: bool) -> dict[str, Any]:
    types = [t for r in routes for t in (r.body, r.answer) if t is not None]
    _, components = msgspec.json.schema_components([*types, ErrorBody], ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, secured)
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "ringserve", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if secured:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return spec


def _operation(route: Route, secured: bool) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, "responses": _responses(route)}
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": _content(route.body)}
    if secured and not route.open:
        op["security"] = [{"bearer": []}]
    return op


def _responses(route: Route) -> dict[str, Any]:
    if route.answer is not None:
        ok: dict[str, Any] = _content(route.answer)
    else:
        ok = {route.media: {"schema": {"type": "string"}}}
    if route.streams:
        ok["text/event-stream"] = {
            "schema": {"type": "string", "description": "data: <chunk JSON> events, then [DONE]"}
        }
    error = {"description": "refused; the body says why", "content": _content(ErrorBody)}
    return {"200": {"description": "OK", "content": ok}, "default": error}


def _content(kind: type) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(name=kind.__name__)}}}
