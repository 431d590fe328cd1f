"""From a request's structured-output fields to StructuredOutputsParams:
OpenAI's `response_format` (`json_object`, `json_schema` with `strict`),
vLLM's `structured_outputs` and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. At most one of them may be given."""

from __future__ import annotations

from typing import Any

from ringserve.engine.grammar import BACKENDS
from ringserve.http.errors import bad_request
from ringserve.http.schemas import SamplingFields
from ringserve.params import StructuredOutputsParams


def structured_params(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint and the field that gave it (for errors)."""
    given = [(name, so) for name, so in _forms(body) if so is not None]
    if len(given) > 1:
        names = [name for name, _ in given]
        raise bad_request(
            f"give at most one structured output, got {', '.join(names)}", param=names[1]
        )
    backend = body.guided_decoding_backend
    if backend is not None and backend not in (*BACKENDS, "llguidance"):
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not available: this server uses guidance",
            param="guided_decoding_backend",
        )
    if not given:
        return None, "structured_outputs"
    name, so = given[0]
    return so, name


def _forms(body: SamplingFields) -> list[tuple[str, StructuredOutputsParams | None]]:
    return [
        ("response_format", _response_format(body)),
        ("structured_outputs", _structured_outputs(body)),
        ("guided_json", _made("guided_json", json=body.guided_json)),
        ("guided_regex", _made("guided_regex", regex=body.guided_regex)),
        ("guided_choice", _made("guided_choice", choice=body.guided_choice)),
        ("guided_grammar", _made("guided_grammar", grammar=body.guided_grammar)),
    ]


def _response_format(body: SamplingFields) -> StructuredOutputsParams | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise bad_request(
            "response_format json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    schema = rf.json_schema.schema
    return StructuredOutputsParams(json=closed(schema) if rf.json_schema.strict else schema)


def _structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    so = body.structured_outputs
    if so is None:
        return None
    # given, it must name something to match: `{}` is refused, as vLLM refuses it
    return _made(
        "structured_outputs",
        required=True,
        json=so.json,
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        json_object=bool(so.json_object),
    )


def _made(field: str, *, required: bool = False, **given: Any) -> StructuredOutputsParams | None:
    """The constraint `field` gives (None when it gives none and need not);
    a 400 naming `field` for one StructuredOutputsParams refuses."""
    kept = {k: v for k, v in given.items() if v is not None and v is not False}
    if not kept and not required:
        return None
    if "choice" in kept:
        kept["choice"] = tuple(kept["choice"])
    try:
        return StructuredOutputsParams(**kept)
    except ValueError as exc:
        raise bad_request(str(exc), param=field) from None


# JSON Schema's keywords whose values are schemas: one, a list of them, or
# a map of names to them. Other values (`const`, `enum`, `default`,
# `examples`, ...) are data, never rewritten.
_ONE_SCHEMA = frozenset(
    {"items", "additionalItems", "additionalProperties", "contains", "not", "if", "then",
     "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
)  # fmt: skip
_LIST_OF_SCHEMAS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP_OF_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def closed(schema: Any, *, whole: bool = True) -> Any:
    """`schema` with every object schema that does not say otherwise closed
    to properties it does not name: OpenAI's strict mode. An object schema
    is one whose `type` is or includes "object", or that names properties.
    An object made of `allOf` branches, each naming only its own
    properties, stays open, and so do the branches (`whole=False`): closed,
    each would refuse the others' properties. What they nest is closed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _MAP_OF_SCHEMAS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in _LIST_OF_SCHEMAS and isinstance(value, list):
            out[key] = [closed(sub, whole=key != "allOf") for sub in value]
        elif key in _ONE_SCHEMA:
            out[key] = closed(value)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    named = is_object or "properties" in out
    if whole and named and "additionalProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out
