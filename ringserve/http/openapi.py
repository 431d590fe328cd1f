"""The API's OpenAPI 3.1 description, built from the same route table that
the app registers, with the body schemas generated from the msgspec
Structs that decode and encode them, so the description says what is
accepted and answered. Two things are added to what msgspec writes: the
rules across fields (`schemas.SCHEMA_RULES`) and the served model's
constraints, such as its context length, where a field names one."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from ringserve.http.errors import ErrorBody
from ringserve.http.schemas import SCHEMA_RULES, SERVED_BY

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REF = "#/components/schemas/{name}"
OPENAPI = web.AppKey("openapi", dict)


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint. `answer` is the JSON body of a 200, a Struct or any
    type msgspec can describe (None: `media` text); `events` is the body of
    each server-sent event that `stream: true` answers instead (sse.py);
    `open` routes need no API key; `match` is aiohttp's path where it
    differs from the described one (a pattern for a parameter)."""

    method: str
    path: str
    handler: Handler
    summary: str
    body: type | None = None
    answer: type | None = None
    media: str = "application/json"
    events: type | None = None
    open: bool = False
    match: str | None = None


def openapi_spec(
    routes: Sequence[Route], version: str, secured: bool, served: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """`served`: the served model's constraints that fields name (schemas.served)."""
    types = [t for r in routes for t in (r.body, r.answer, r.events) if _is_struct(t)]
    _, components = msgspec.json.schema_components([*types, ErrorBody], ref_template=REF)
    for name, rules in SCHEMA_RULES.items():
        _merge(components[name], rules)
    for kind in {r.body for r in routes if _is_struct(r.body)}:
        _nullable(components[kind.__name__])
    components = _bind(components, served)
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
    names = re.findall(r"\{(\w+)\}", route.path)
    if names:
        string = {"type": "string"}
        op["parameters"] = [
            {"name": n, "in": "path", "required": True, "schema": string} for n in names
        ]
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
    if route.events is not None:
        ok["text/event-stream"] = {"schema": _event(route.events)}
    error = {"description": "refused; the body says why", "content": _content(ErrorBody)}
    return {"200": {"description": "OK", "content": ok}, "default": error}


def _content(kind: Any) -> dict[str, Any]:
    if _is_struct(kind):
        return {"application/json": {"schema": {"$ref": REF.format(name=kind.__name__)}}}
    return {"application/json": {"schema": msgspec.json.schema(kind)}}


def _event(kind: type) -> dict[str, Any]:
    """One server-sent event: a `kind` chunk, an error after the stream
    began, or the closing `[DONE]`."""
    chunk = {"anyOf": [{"$ref": REF.format(name=n)} for n in (kind.__name__, "ErrorBody")]}
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": chunk}
    return {
        "type": "object",
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
        "required": ["data"],
    }


def _is_struct(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


def _merge(schema: dict[str, Any], rules: dict[str, Any]) -> None:
    """Add `rules` to a Struct's schema; a property they name is replaced."""
    for key, value in rules.items():
        if key == "properties":
            schema["properties"].update(value)
        else:
            schema[key] = value


def _nullable(schema: dict[str, Any]) -> None:
    """A request body's optional fields also take null, which means their
    default (schemas.read_json)."""
    required = set(schema.get("required", ()))
    for name, prop in schema["properties"].items():
        if name not in required and not _takes_null(prop):
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}]}


def _takes_null(prop: dict[str, Any]) -> bool:
    kind = prop.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(_takes_null(p) for p in [*prop.get("anyOf", ()), *prop.get("oneOf", ())])


def _bind(schema: Any, served: dict[str, dict[str, Any]]) -> Any:
    """`schema` with each named constraint of the served model written in."""
    if isinstance(schema, list):
        return [_bind(s, served) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bind(v, served) for k, v in schema.items() if k != SERVED_BY}
    if SERVED_BY in schema:
        out |= served[schema[SERVED_BY]]
    return out
