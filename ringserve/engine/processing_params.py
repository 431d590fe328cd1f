"""Rank 0's part of logits processing: checking a request's token ids
against the vocabulary and turning its `bad_words` into token ids, before
the request is numbered (so the scheduler, its log and its re-run see the
ids, never the tokenizer)."""

from __future__ import annotations

import dataclasses

from ringserve.models.tokenizer import Tokenizer
from ringserve.params import SamplingParams


def processing_params(
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    context: int,
    eos_ids: frozenset[int] = frozenset(),
) -> SamplingParams:
    """`params` checked, with `bad_words_token_ids` filled in and a
    `max_tokens` of None made the `context` (which ends the request first
    anyway); ValueError naming the field otherwise, and for bans that leave
    `allowed_token_ids` no token to draw (`eos_ids`: the model's ends of
    sequence, which `min_tokens` bans)."""
    params = _resolved(params, tokenizer, vocab_size, context)
    _check_something_is_drawable(params, eos_ids)
    return params


def _check_something_is_drawable(params: SamplingParams, eos_ids: frozenset[int]) -> None:
    if params.allowed_token_ids is None:
        return
    left = set(params.allowed_token_ids) - {w[0] for w in params.bad_words_token_ids if len(w) == 1}
    if not left:
        raise ValueError("bad_words ban every token of allowed_token_ids: none could be drawn")
    if params.min_tokens > 0 and not left - params.ending_ids(eos_ids):
        raise ValueError(
            f"allowed_token_ids {sorted(left)} are all ends of sequence or stop_token_ids, "
            f"which min_tokens {params.min_tokens} bans: none could be drawn"
        )


def _resolved(
    params: SamplingParams, tokenizer: Tokenizer | None, vocab_size: int, context: int
) -> SamplingParams:
    if params.max_tokens is None:
        if params.min_tokens > context:
            raise ValueError(
                f"min_tokens {params.min_tokens} is more than the {context} tokens the "
                "model's context holds (max_tokens was not given)"
            )
        params = dataclasses.replace(params, max_tokens=context)
    if params.stop and tokenizer is None:  # matched in text, which needs one
        raise ValueError("stop strings need a tokenizer: this model has none (use stop_token_ids)")
    biased = () if params.logit_bias is None else params.logit_bias
    allowed = () if params.allowed_token_ids is None else params.allowed_token_ids
    named = (
        ("logit_bias", list(biased)),
        ("allowed_token_ids", list(allowed)),
        ("stop_token_ids", list(params.stop_token_ids)),
    )
    for name, ids in named:
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"{name} names token id {bad}, outside the vocabulary of {vocab_size} tokens"
            )
    if not params.bad_words or params.bad_words_token_ids:
        return params
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer: this model has none")
    return dataclasses.replace(
        params, bad_words_token_ids=bad_word_ids(params.bad_words, tokenizer)
    )


def bad_word_ids(words: tuple[str, ...], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens as written and after a space, as vLLM bans both
    (the second only when it differs from the first)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)
