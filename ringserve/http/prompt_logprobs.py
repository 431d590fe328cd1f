"""Prompt logprobs in the API's two forms: OpenAI's `echo` with `logprobs`
(the choice's logprobs cover the prompt's tokens first, the first with a
null logprob) and vLLM's `prompt_logprobs` field (per prompt token a map of
token id to its record)."""

from __future__ import annotations

from ringserve.http.logprobs import completion_logprobs, token_text
from ringserve.http.responses import CompletionLogprobs, PromptLogprob, PromptLogprobsBody
from ringserve.http.schemas import CompletionRequest
from ringserve.models.tokenizer import Tokenizer

Judged = list[dict[int, float] | None]


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many top logprobs each prompt position needs: vLLM's field, or
    with `echo`, as many as the generated tokens get."""
    echoed = body.logprobs if body.echo else None
    if body.prompt_logprobs is None:
        return echoed
    return max(body.prompt_logprobs, echoed or 0)


def prompt_logprobs_body(
    tokenizer: Tokenizer | None, judged: Judged | None
) -> PromptLogprobsBody | None:
    if judged is None:
        return None
    return [
        None
        if alts is None
        else {str(t): PromptLogprob(lp, token_text(tokenizer, t)) for t, lp in alts.items()}
        for alts in judged
    ]


def echoed_logprobs(
    tokenizer: Tokenizer | None, prompt: list[int], judged: Judged, top: int, text: str
) -> CompletionLogprobs:
    """The prompt's part of an echoed choice's logprobs: each token's own
    logprob and its position's `top` most likely (the first token: null;
    with `top` 0 no top logprobs, as for the generated tokens).
    `text`: the echoed prompt, which the offsets index (a BOS the tokenizer
    added begins where the prompt does)."""
    own: list[float | None] = [None]
    tops: list[dict[int, float] | None] = [None]
    for t, alts in zip(prompt[1:], judged[1:], strict=True):
        if alts is None:
            raise ValueError("a prompt token past the first has no logprobs")
        own.append(alts[t])
        best = sorted(alts.items(), key=lambda kv: -kv[1])[:top]
        tops.append(dict(best))
    starts = None if tokenizer is None else tokenizer.char_starts(text, prompt)
    lp = completion_logprobs(tokenizer, prompt, [0.0] * len(prompt), None, starts=starts)
    if top == 0:  # as the generated tokens' own: no top logprobs at all
        return CompletionLogprobs(lp.tokens, own, None, lp.text_offset)
    texts = [
        None if alts is None else {token_text(tokenizer, t): v for t, v in alts.items()}
        for alts in tops
    ]
    return CompletionLogprobs(lp.tokens, own, texts, lp.text_offset)


def joined(head: CompletionLogprobs, tail: CompletionLogprobs | None) -> CompletionLogprobs:
    """`head`'s tokens, then `tail`'s (whose offsets follow head's text)."""
    if tail is None:
        return head
    tops = None
    if head.top_logprobs is not None or tail.top_logprobs is not None:
        tops = (head.top_logprobs or [None] * len(head.tokens)) + (
            tail.top_logprobs or [None] * len(tail.tokens)
        )
    return CompletionLogprobs(
        head.tokens + tail.tokens,
        head.token_logprobs + tail.token_logprobs,
        tops,
        head.text_offset + tail.text_offset,
    )
