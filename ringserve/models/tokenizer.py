"""Text <-> token ids for a model directory: `tokenizer.json` through the
`tokenizers` library, special tokens and the chat template from
`tokenizer_config.json` (or `chat_template.jinja`), rendered as Hugging Face
renders it: a sandboxed jinja2 environment with `raise_exception`,
`strftime_now` and a non-escaping `tojson`.

Decoding applies no `clean_up_tokenization_spaces`: Hugging Face itself
skips it for BPE tokenizers, the only kind the served families use.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in
    a piece, inverted. Printable bytes stand for themselves; the others are
    written as the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars |= {b: chr(0x100 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = MappingProxyType(_byte_alphabet())


class Tokenizer:
    """A loaded tokenizer. Immutable after construction; safe to share
    between tasks (the backend is thread-safe for encode/decode)."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        tool_template: str | None = None,
    ) -> None:
        """`tool_template`: the template a model names `tool_use`, which
        Hugging Face renders instead when tools are given."""
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._template = None if chat_template is None else _compile(chat_template)
        self._tool_template = None if tool_template is None else _compile(tool_template)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """None when the directory has no tokenizer.json: such a model still
        serves prompts given as token ids."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        specials = {
            name: _token_text(config[name])
            for name in _SPECIAL_NAMES
            if config.get(name) is not None
        }
        # As Hugging Face reads them: a chat_template.jinja file first, then the
        # config's template, or its list of named ones ("default", "tool_use").
        template_file = model_dir / "chat_template.jinja"
        named = _named_templates(config.get("chat_template"))
        if template_file.is_file():
            named["default"] = template_file.read_text()
        backend = BackendTokenizer.from_file(str(path))
        return cls(backend, specials, named.get("default"), named.get("tool_use"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the tokenizer's post-processing (a BOS,
        say) as Hugging Face adds it. Pass add_special_tokens=False for a
        rendered chat prompt: its template already wrote them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def char_starts(self, text: str, ids: list[int]) -> list[int] | None:
        """Where each of `ids` begins in `text`, when encoding `text` gives
        exactly `ids` (None otherwise): a token added by the tokenizer (a
        BOS) begins where the next one does."""
        encoding = self.backend.encode(text)
        if encoding.ids != list(ids):
            return None
        starts, reached = [], 0
        for _, end in encoding.offsets:
            starts.append(reached)
            reached = max(reached, end)
        return starts

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, also when they are only part of a
        character (a byte-level piece, a `<0xE2>` byte-fallback piece), which
        its decoding alone shows as U+FFFD; None for an id out of range."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return None
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _added(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps pieces' characters to bytes (GPT-2's
        byte-level alphabet)."""
        return '"ByteLevel"' in json.dumps(json.loads(self.backend.to_str()).get("decoder"))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the model's chat template. `variables`
        (tools, a template's own switches, ...) reach the template as
        Hugging Face passes them, and may set `add_generation_prompt` too;
        never `messages`."""
        if self._template is None:
            raise ValueError(
                "this model has no chat template (no chat_template in "
                "tokenizer_config.json): send a plain completion prompt instead"
            )
        variables = dict(variables or {})
        if "messages" in variables:
            raise ValueError("the template's variables may not set messages")
        template = self._template
        if variables.get("tools") and self._tool_template is not None:
            template = self._tool_template
        context = {
            **self.special_tokens,
            "add_generation_prompt": add_generation_prompt,
            "tools": None,  # defined, as Hugging Face passes them
            "documents": None,
        }
        normal = [_normalized(m) for m in messages]
        try:
            return template.render({**context, **variables, "messages": normal})
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"chat template failed on the messages: {e}") from e


class IncrementalDecoder:
    """Streams text for a growing list of token ids. Invariant: the deltas
    returned by `push` and then `flush` concatenate to
    `tokenizer.decode(all ids)`, except where decoding more tokens changes
    text already shown: a byte-fallback decoder turns every byte of a run
    that a later byte makes invalid into U+FFFD, a character shown before
    it too; what was shown stays, and the new tokens are decoded alone
    (`stream_text` is that text, decoded at once).

    Text is decoded over a short window: the tokens since the last emission
    plus the ones before them (`prefix_offset`) for context, since some
    decoders render a token differently at the start of a string. Text that
    ends in U+FFFD (an incomplete UTF-8 sequence of byte-level pieces) is held
    back until the following tokens complete it."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (maybe "")."""
        self._ids.append(token_id)
        window = self._decode(self._ids[self._prefix_offset :])
        if window.endswith("\ufffd"):
            return ""
        return self._advance(window)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back."""
        return self._advance(self._decode(self._ids[self._prefix_offset :]))

    def _advance(self, window: str) -> str:
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if not window.startswith(before):  # the new tokens changed what was shown
            window = before + self._decode(self._ids[self._read_offset :])
        if len(window) <= len(before):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


def stream_text(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids` as a stream of them shows it: their decoding,
    unless that holds U+FFFD, where a stream may show more (see
    IncrementalDecoder)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if "\ufffd" not in text:
        return text
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
    return "".join(decoder.push(t) for t in ids) + decoder.flush()


def _token_text(value: Any) -> str:
    # tokenizer_config stores a special token as a string or as an AddedToken dict.
    return value["content"] if isinstance(value, dict) else str(value)


def _named_templates(value: Any) -> dict[str, str]:
    """The config's chat template: one, or a list of named ones."""
    if isinstance(value, list):
        return {t.get("name"): t.get("template") for t in value if t.get("template")}
    return {} if value is None else {"default": value}


_REASONING_NAMES = ("reasoning_content", "reasoning", "thinking")


def _template_arguments(arguments: Any) -> Any:
    """A tool call's arguments as chat templates read them: an object, where
    OpenAI's shape sends them as JSON text (text that is not JSON stays)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _normalized(message: dict[str, Any]) -> dict[str, Any]:
    """A message as Hugging Face hands it to a template: keys whose value is
    None left out but `content` (None is empty text, as an assistant's turn
    of tool calls has it), and the reasoning under each of its names; and
    from OpenAI's shapes, `developer` as `system`, text parts as their text
    and tool call arguments as objects."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("role") == "developer":
        out["role"] = "system"
    content = out.setdefault("content", "")
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_template_call(c) for c in calls]
    if isinstance(content, list):
        kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
        if any(k != "text" for k in kinds):
            raise ValueError(f"message content parts must be text parts, got {kinds}")
        out["content"] = "".join(p.get("text") or "" for p in content)
    reasoning = next((out[k] for k in _REASONING_NAMES if k in out), None)
    if reasoning is not None:
        out |= {k: out.get(k, reasoning) for k in _REASONING_NAMES}
    return out


def _template_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or "arguments" not in function:
        return call
    arguments = _template_arguments(function["arguments"])
    return {**call, "function": {**function, "arguments": arguments}}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}...{% endgeneration %}` (it marks the
    assistant's tokens for training): rendered as its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
