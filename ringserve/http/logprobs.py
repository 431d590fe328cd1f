"""Log-probabilities in OpenAI's two formats: the completions one (parallel
lists) and the chat one (a record per token). A token's string is its own
decoding, special tokens included; with no tokenizer it is `token_id:<id>`.
`bytes` are the bytes the token stands for, also when they are only part of
a character, which its string shows as U+FFFD (`Tokenizer.token_bytes`): the
text is the concatenation of its tokens' bytes."""

from __future__ import annotations

from ringserve.http.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from ringserve.models.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer | None,
    token_ids: list[int],
    logprobs: list[float],
    top: list[dict[int, float]] | None,
    offset: int = 0,
    starts: list[int] | None = None,
) -> CompletionLogprobs:
    """`offset` is where this piece's text begins in the choice's text;
    `starts`, where each token begins in it, when known (else each token's
    string is taken to follow the last's)."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = starts
    if offsets is None:
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
    tops = None
    if top is not None:
        tops = [{token_text(tokenizer, t): lp for t, lp in alts.items()} for alts in top]
    return CompletionLogprobs(tokens, list(logprobs), tops, offsets)


def chat_logprobs(
    tokenizer: Tokenizer | None,
    token_ids: list[int],
    logprobs: list[float],
    top: list[dict[int, float]] | None,
) -> ChatLogprobs:
    records = []
    for i, (token_id, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        alts = [] if top is None else [_top(tokenizer, t, v) for t, v in top[i].items()]
        sampled = _top(tokenizer, token_id, lp)
        records.append(TokenLogprob(sampled.token, lp, sampled.bytes, alts))
    return ChatLogprobs(records)


def _top(tokenizer: Tokenizer | None, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    raw = None if tokenizer is None else tokenizer.token_bytes(token_id)
    return TopLogprob(text, logprob, list(text.encode() if raw is None else raw))
