"""Structured outputs on rank 0: one grammar matcher per constrained request
(llguidance), and the packed bitmask of each constrained row of a pass.

Where the state lives (DESIGN §3.11): rank 0 decides every pass and a
request has at most one sampling pass in flight, so when rank 0 schedules a
row it knows every token the request has accepted. The matcher advances
only when an Output is applied (`accept`), so a void never advances it, a
retraction leaves it as it was, and a replay of the logged tokens rebuilds
it exactly. The mask of a pass is filled on a worker thread while rank 0's
own forward runs and travels beside the pass's Hidden to the sampling rank,
which only applies it: every rank agrees on what was allowed because only
one rank ever computed it.

Compilation never runs on the event loop: `prepare` compiles in a thread
and caches a fresh matcher per grammar (by its canonical key), and a
request's matcher is a copy of it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import numpy as np
import torch

from ringserve.config import json_object
from ringserve.params import StructuredOutputsParams

BACKENDS = ("guidance", "auto")  # llguidance; `auto` picks it
CACHED_GRAMMARS = 256  # compiled grammars kept, least recently used dropped
GRAMMAR_STOP = "stop"
GRAMMAR_FAILED = "grammar failed"  # begins the reason (after "error: ") of a request it failed


def mask_words(vocab_size: int) -> int:
    """Words of a packed mask row: bit t of word t // 32 allows token t."""
    return (vocab_size + 31) // 32


class GrammarError(ValueError):
    """A grammar or schema the engine cannot compile; the message says why."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """The server's structured-outputs options, vLLM's
    `--structured-outputs-config` (a JSON object): `backend` and
    `disable_any_whitespace` (default true here: JSON is compact, so a weak
    model cannot wander through free runs of whitespace until max_tokens)."""

    backend: str = "guidance"
    disable_any_whitespace: bool = True

    @classmethod
    def parse(cls, text: str | None) -> StructuredOutputsConfig:
        if text is None:
            return cls()
        raw = json_object(text, "structured outputs config")
        unknown = sorted(set(raw) - {"backend", "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"structured outputs config has unknown keys {unknown}")
        backend = raw.get("backend", "guidance")
        if backend not in BACKENDS:
            raise ValueError(
                f"structured outputs backend {backend!r} is not available here; "
                f"choose one of {list(BACKENDS)} (llguidance)"
            )
        flag = raw.get("disable_any_whitespace", True)
        if not isinstance(flag, bool):
            raise ValueError("disable_any_whitespace must be true or false")
        return cls("guidance", flag)


def grammar_source(so: StructuredOutputsParams, compact: bool) -> str:
    """The llguidance grammar of `so`; GrammarError when its input is malformed."""
    options = {"whitespace_flexible": not compact}
    if so.json is not None or so.json_object:
        schema: Any = {"type": "object"} if so.json is None else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("the JSON schema must be an object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is invalid: {exc}") from None
    if so.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        lark = "start: " + " | ".join(json.dumps(c) for c in so.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    assert so.grammar is not None
    text = so.grammar
    if "::=" in text:  # GBNF, as llama.cpp and xgrammar write it
        try:
            text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain exceptions
            raise GrammarError(f"the grammar is not valid GBNF: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


@dataclass(frozen=True, slots=True)
class GrammarStart:
    grammars: Grammars
    matcher: llguidance.LLMatcher

    def bind(self, req_id: int) -> None:
        self.grammars._matchers[req_id] = self.matcher


class Grammars:
    """Rank 0's matchers. Invariant: the matcher of request r has consumed
    exactly r's accepted output tokens; `_templates` holds fresh matchers
    for the most recently used grammars."""

    def __init__(
        self,
        tokenizer_path: Path | None,
        vocab_size: int,
        eos_ids: Sequence[int],
        config: StructuredOutputsConfig,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.config = config
        self.words = mask_words(vocab_size)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # compiles run in threads
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None

    async def prepare(self, so: StructuredOutputsParams) -> None:
        """Compile `so`'s grammar off the event loop (cached); GrammarError
        when it cannot be compiled."""
        if so.key() not in self._templates:
            await asyncio.to_thread(self._template, so)

    def starter(self, so: StructuredOutputsParams) -> GrammarStart:
        """A fresh matcher of `so`'s grammar, to bind to a request once it
        is numbered (compiled here if `prepare` did not); GrammarError when
        it cannot compile."""
        return GrammarStart(self, self._template(so).deep_copy())

    def drop(self, req_id: int) -> None:
        self._matchers.pop(req_id, None)

    def constrained(self, req_id: int) -> bool:
        return req_id in self._matchers

    def accept(self, req_id: int, token: int) -> str | None:
        """Advance request `req_id`'s matcher by its accepted token. Returns
        "stop" when the grammar is complete, an error reason when the token
        breaks it, None otherwise."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return None
        if not matcher.consume_token(token):
            # the matcher's first line says why; the rest is its statistics
            why = next(iter((matcher.get_error() or "").splitlines()), "")[:300]
            return (
                f"error: {GRAMMAR_FAILED}: token {token} breaks it ({why}); the grammar may "
                "never let the output end, or another constraint of the request "
                "(allowed_token_ids, bad_words, a bias) may leave it no token"
            )
        return GRAMMAR_STOP if matcher.is_stopped() else None

    def masks(self, req_ids: Sequence[int]) -> torch.Tensor:
        """The packed masks [k, W] of the masked rows of a pass (their
        requests, in entry order). A request without a matcher (none is
        scheduled: a constrained request keeps its matcher until it is
        retired) gets a row that allows everything."""
        bits = torch.full((len(req_ids), self.words), -1, dtype=torch.int32)
        targets = [(self._matchers[r], k) for k, r in enumerate(req_ids) if r in self._matchers]
        if not targets:
            return bits
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # llguidance.torch would import torch.compile for its one call, this:
        ptr, size = bits.data_ptr(), self.words * 4
        self._executor.unsafe_compute_mask_ptr(targets, ptr, size, len(req_ids))
        return bits

    def _template(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = so.key()
        with self._lock:
            cached = self._templates.get(key)
            if cached is not None:
                self._templates.move_to_end(key)
                return cached
            grammar = grammar_source(so, self.config.disable_any_whitespace)
            matcher = llguidance.LLMatcher(self._tokenizer_locked(), grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(_what(so, matcher.get_error()))
            if not matcher.is_accepting() and not self._allows_more_than_eos(matcher):
                # llguidance lets a grammar that matches nothing (a $ref that
                # only refers to itself) end at once, as an empty output
                raise GrammarError(f"the {so.kind} matches nothing: no output can satisfy it")
            self._templates[key] = matcher
            while len(self._templates) > CACHED_GRAMMARS:
                self._templates.popitem(last=False)
            return matcher

    def _allows_more_than_eos(self, matcher: llguidance.LLMatcher) -> bool:
        """Whether `matcher`'s mask, in its present state, allows a token
        other than the end of sequence."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32).copy()
        for eos in self.eos_ids:
            bits[eos // 32] &= ~np.uint32(1 << (eos % 32))
        return bool(bits.any())

    def _tokenizer_locked(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self.tokenizer_path is None:
                raise GrammarError("structured outputs need the model's tokenizer.json")
            text = self.tokenizer_path.read_text()
            eos = self.eos_ids or None
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer


def _what(so: StructuredOutputsParams, error: str) -> str:
    kind = so.kind
    return f"the {kind} cannot be compiled: {error}"


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`logits` [S, V] with every token its row's mask does not allow at
    -inf (rows not in `rows` are left alone). The sampling rank's one use of
    a mask; a new tensor."""
    rows, bits = rows.to(logits.device), bits.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)
    vocab = logits.shape[-1]
    if allowed.shape[-1] < vocab:
        pad = torch.zeros(
            len(rows), vocab - allowed.shape[-1], dtype=torch.bool, device=logits.device
        )
        allowed = torch.cat([allowed, pad], -1)
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
    return out
