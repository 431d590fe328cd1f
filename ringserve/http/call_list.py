"""Reads the answer of a `required` tool choice, a JSON list of calls
`[{"name": ..., "parameters": {...}}, ...]` (the grammar's, http/tools.py),
as it grows: a call opens once its name is read, and its arguments are the
raw text of its `parameters` value, handed on piece by piece as the text
arrives. The whole answer read at once gives the same calls, so a streamed
answer's arguments are the non-streamed ones."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_CALL_DEPTH = 2  # inside [ { ... } ]


@dataclass(slots=True)
class Call:
    index: int
    name: str | None = None
    arguments: str = ""
    sent: int = 0  # of `arguments`, handed on
    opened: bool = False


@dataclass(slots=True)
class Piece:
    """What one push adds to one call: its opening (with the name) when
    `opens`, and more argument text."""

    index: int
    name: str
    opens: bool
    arguments: str


@dataclass(slots=True)
class CallListReader:
    """Invariant: `calls` holds every call begun so far; each call's
    `arguments` is the text of its `parameters` value read so far."""

    calls: list[Call] = field(default_factory=list)
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    key: str | None = None  # the key whose value is being read, at call depth
    after_colon: bool = False
    raw: str = ""  # the call-depth string being read (a key or the name)
    capturing: bool = False  # inside the `parameters` value

    def push(self, text: str) -> list[Piece]:
        """Read more of the answer; the pieces it adds, call by call."""
        for ch in text:
            self._char(ch)
        return self._pieces()

    def read_all(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments) of every call of an answer whose name was read
        (all of a whole answer's; of one cut short, those a stream opened)."""
        self.push(text)
        return [(c.name, c.arguments) for c in self.calls if c.name is not None]

    def _pieces(self) -> list[Piece]:
        out = []
        for c in self.calls:
            if c.name is None:
                continue  # its arguments wait for its name
            new = c.arguments[c.sent :]
            if new or not c.opened:
                out.append(Piece(c.index, c.name, not c.opened, new))
                c.opened, c.sent = True, len(c.arguments)
        return out

    def _char(self, ch: str) -> None:
        if self.capturing:
            self._capture(ch)
            return
        if self.in_string:
            self.raw += ch
            self._string_char(ch)
            if not self.in_string and self.depth == _CALL_DEPTH:
                self._string_done()
            return
        if ch == '"':
            self.in_string, self.raw = True, ch
        elif ch in "[{":
            self.depth += 1
            if self.depth == _CALL_DEPTH:
                self.calls.append(Call(len(self.calls)))
                self.key, self.after_colon = None, False
        elif ch in "]}":
            self.depth -= 1
        elif self.depth == _CALL_DEPTH and ch == ":":
            self.after_colon = True
        elif self.depth == _CALL_DEPTH and ch == ",":
            self.key, self.after_colon = None, False
        if self.depth == _CALL_DEPTH + 1 and ch in "[{" and self._in_parameters():
            self.capturing = True
            self.calls[-1].arguments += ch
        elif self.depth == _CALL_DEPTH and self._in_parameters() and not ch.isspace():
            if ch not in ":,}":
                self.capturing = True  # a value that is not an object: read as is
                self.calls[-1].arguments += ch

    def _in_parameters(self) -> bool:
        return self.after_colon and self.key == "parameters" and not self.calls[-1].arguments

    def _capture(self, ch: str) -> None:
        """A character of the `parameters` value (which began at call depth)."""
        call = self.calls[-1]
        if self.in_string:
            call.arguments += ch
            self._string_char(ch)
            return
        if self.depth == _CALL_DEPTH and (ch in ",}" or ch.isspace()):
            self.capturing = False  # a plain value ended
            self._char(ch)
            return
        call.arguments += ch
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1
            if self.depth == _CALL_DEPTH:
                self.capturing = False

    def _string_char(self, ch: str) -> None:
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False

    def _string_done(self) -> None:
        value = json.loads(self.raw)
        if not self.after_colon:
            self.key = value
        elif self.key == "name":
            self.calls[-1].name = value
