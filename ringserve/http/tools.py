"""Tool calls in chat, as vLLM's OpenAI server does them.

`tool_choice`:
* `none`: the tools are not offered; the answer is text.
* a named function, or `required`: the answer is constrained by a grammar
  (the function's `parameters` schema, closed as OpenAI's strict mode closes
  it where the function says `strict`; for `required`, a JSON list of calls
  of the offered functions), so it always parses.
* `auto`: the tools are rendered through the model's chat template and the
  answer is parsed by the server's tool-call parser (`--tool-call-parser`,
  with `--enable-auto-tool-choice`).

Parsers implement `ToolParser`; `hermes` reads `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`, as the Hermes and Qwen templates write
them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from ringserve.http.call_list import CallListReader, Piece
from ringserve.http.errors import bad_request
from ringserve.http.responses import ChatDelta, FunctionCall, FunctionDelta, ToolCall, ToolCallDelta
from ringserve.http.structured import closed
from ringserve.params import StructuredOutputsParams


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Parsed:
    """An answer split into its text and its tool calls."""

    content: str | None
    calls: list[ToolCall]


class ToolParser(Protocol):
    """Reads the tool calls out of a model's answer."""

    name: str

    def parse(self, text: str) -> Parsed: ...

    def safe_prefix(self, text: str) -> int:
        """How much of `text` (a prefix of the answer) is surely content, so
        a stream may send it before the answer is complete."""
        ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        if self.START not in text:
            return Parsed(text, [])
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                return Parsed(text, [])  # not a call after all: the text is the answer
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return Parsed(text, [])
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ToolCall(call_id(), FunctionCall(call["name"], _json(arguments))))
        content = text[: text.index(self.START)].strip()
        return Parsed(content or None, calls)

    def safe_prefix(self, text: str) -> int:
        at = text.find(self.START)
        if at >= 0:
            return at
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


PARSERS: dict[str, type] = {"hermes": HermesParser}


def make_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]()


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools ask of the engine: the tools to render
    (None: none), the grammar of a named or required call, and how the
    answer becomes tool calls (`mode`: none, auto, required or named)."""

    mode: str
    tools: list[dict[str, Any]] | None
    grammar: StructuredOutputsParams | None = None
    function: str | None = None


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool,
    parser: ToolParser | None,
) -> ToolPlan:
    """The plan for a request's `tools` and `tool_choice`; a 400 naming the
    field when they do not fit together or the server cannot serve them."""
    functions = tool_functions(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions and parser is not None else "none"
    if tool_choice == "none" or not functions:
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise bad_request("tool_choice names tools, but no tools are given", param="tools")
        return ToolPlan("none", None)
    if tool_choice == "auto":
        if parser is None:
            raise bad_request(
                'tool_choice "auto" needs a server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        return ToolPlan("auto", tools)
    if tool_choice == "required":
        grammar = StructuredOutputsParams(json=_calls_schema(functions, parallel))
        return ToolPlan("required", tools, grammar)
    name = _named(tool_choice)
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not a tool", param="tool_choice")
    return ToolPlan("named", tools, StructuredOutputsParams(json=functions[name]), name)


def tool_functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each function's name and parameters schema (closed to properties it
    does not name where the function is `strict`, as OpenAI's strict mode
    is); a 400 naming the tool that is not a named function."""
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"tools[{i}] must be a function with a name", param=f"tools[{i}].function"
            )
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object",
                param=f"tools[{i}].function.parameters",
            )
        out[fn["name"]] = closed(params) if fn.get("strict") is True else params
    return out


def _named(choice: str | dict[str, Any]) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return fn["name"]


def _calls_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each of an offered function with its parameters."""
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls of a grammar-constrained answer (named or required)."""
    if plan.mode == "named":
        assert plan.function is not None
        return [ToolCall(call_id(), FunctionCall(plan.function, text))]
    calls = CallListReader().read_all(text)
    return [ToolCall(call_id(), FunctionCall(name, arguments)) for name, arguments in calls]


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolStream:
    """One choice's stream under a tool plan: turns text deltas into chat
    deltas as OpenAI streams tool calls (a call's id, type and name first,
    its arguments after, as deltas; a `required` answer's calls are read
    as the list grows, http/call_list.py)."""

    def __init__(self, plan: ToolPlan, parser: ToolParser | None) -> None:
        self.plan, self.parser = plan, parser
        self.text = ""
        self.sent = 0  # of `text`, as content (auto) or arguments (named)
        self.opened = False
        self.called = False
        self.calls = CallListReader()

    def push(self, text: str) -> list[ChatDelta]:
        """Deltas for new text of the answer."""
        self.text += text
        if self.plan.mode == "named":
            out = [] if self.opened else [self._open(0, self.plan.function or "")]
            self.opened = True
            if text:
                out.append(ChatDelta(tool_calls=[ToolCallDelta(0, FunctionDelta(arguments=text))]))
            return out
        if self.plan.mode == "auto" and self.parser is not None:
            upto = self.parser.safe_prefix(self.text)
            if upto > self.sent:
                piece, self.sent = self.text[self.sent : upto], upto
                return [ChatDelta(content=piece)]
            return []
        if self.plan.mode == "none":
            self.sent = len(self.text)
            return [ChatDelta(content=text)] if text else []
        self.sent = len(self.text)  # required: the list's calls, as they grow
        return [d for piece in self.calls.push(text) for d in self._piece(piece)]

    def finish(self, finish_reason: str) -> tuple[list[ChatDelta], str]:
        """Deltas still owed at the end, and the finish reason to send."""
        mode = self.plan.mode
        if mode == "named":
            return [], finish_reason
        if mode == "required":  # its calls went out as they grew
            return [], "tool_calls" if finish_reason == "stop" else finish_reason
        if mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(self.text)
            if parsed.calls:
                return self._calls(parsed.calls), "tool_calls"
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return ([ChatDelta(content=rest)] if rest else []), finish_reason

    def _calls(self, calls: list[ToolCall]) -> list[ChatDelta]:
        out = []
        for i, call in enumerate(calls):
            out.append(self._open(i, call.function.name, call.id))
            out.append(
                ChatDelta(
                    tool_calls=[ToolCallDelta(i, FunctionDelta(arguments=call.function.arguments))]
                )
            )
        return out

    def _piece(self, piece: Piece) -> list[ChatDelta]:
        out = [self._open(piece.index, piece.name)] if piece.opens else []
        if piece.arguments:
            args = FunctionDelta(arguments=piece.arguments)
            out.append(ChatDelta(tool_calls=[ToolCallDelta(piece.index, args)]))
        return out

    @staticmethod
    def _open(i: int, name: str, id_: str | None = None) -> ChatDelta:
        first = ToolCallDelta(
            i, FunctionDelta(name=name, arguments=""), call_id() if id_ is None else id_, "function"
        )
        return ChatDelta(tool_calls=[first])
