"""Detokenisation and stop strings on rank 0: the text of one request,
released delta by delta and cut at the first stop string."""

from __future__ import annotations

from ringserve.models.tokenizer import IncrementalDecoder, Tokenizer, stream_text


class TextStream:
    """Invariant: `text` is everything released so far; text that could be
    the start of a stop string is held back until it is decided. A stream
    that nobody reads delta by delta (`incremental=False`) and has no stop
    strings decodes once, at the end, to the same text."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: tuple[str, ...] = (),
        incremental: bool = True,
        min_tokens: int = 0,
    ) -> None:
        """Stop strings are looked for from the `min_tokens`-th token on, as
        vLLM does (text before it is released as it comes)."""
        self._tokenizer = tokenizer
        self._min_tokens = min_tokens
        self._pushed = 0
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._deferred: list[int] | None = None if incremental or stop else []
        self._stop = stop
        self._held = ""
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    def push(self, token_id: int) -> str:
        """Feed one generated token; returns the text it releases."""
        if self.stopped or self._decoder is None:
            return ""
        if self._deferred is not None:
            self._deferred.append(token_id)
            return ""
        self._pushed += 1
        self._held += self._decoder.push(token_id)
        if self._pushed < self._min_tokens:  # no stop string counts yet
            delta, self._held = self._held, ""
            self.text += delta
            return delta
        return self._release(final=False)

    def finish(self) -> str:
        """Release what was held back once generation has ended."""
        if self.stopped or self._decoder is None:
            return ""
        if self._deferred is not None:
            self.text = stream_text(self._tokenizer, self._deferred)
            return self.text
        self._held += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # Held-back text is every suffix that could begin a stop string, so a
        # stop string can only start inside what is held.
        hits = [(at, k) for k, s in enumerate(self._stop) if (at := self._held.find(s)) >= 0]
        if hits:
            at, k = min(hits)  # the earliest; at one place, the first listed
            delta, self.stop_string = self._held[:at], self._stop[k]
            self._held, self.stopped = "", True
        else:
            keep = 0 if final else _partial_stop(self._held, self._stop)
            delta = self._held[: len(self._held) - keep]
            self._held = self._held[len(delta) :]
        self.text += delta
        return delta


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best
