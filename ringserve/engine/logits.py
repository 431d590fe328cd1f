"""Logits processing on the sampling rank: what shifts or bans a row's next
token before it is drawn, in vLLM's meanings and in this order:

1. `logit_bias` (token id -> bias, clamped to [-100, 100] on rank 0);
2. `repetition_penalty` over every token of the prompt and the output: a
   positive logit is divided by it, a negative one multiplied;
3. `frequency_penalty` x count and `presence_penalty` x (count > 0) over
   the output tokens, subtracted;
4. bans: EOS and stop ids while fewer than `min_tokens` were generated,
   every token outside `allowed_token_ids`, and the last token of a bad word
   whose other tokens end the output.

A row's processing is a function of (its logits, the request's tokens, its
spec) and nothing else, so it can be applied at any position: the tokens are
the row's context up to the position being drawn (`Row.tokens`, which the
replica keeps exactly from the self-describing entries, voids and
retractions included), and nothing here keeps state between passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringserve.ring.messages import SamplingSpec


def processes(spec: SamplingSpec) -> bool:
    """Whether `spec` changes its row's logits at all."""
    return (
        spec.needs_history
        or spec.logit_bias is not None
        or spec.min_tokens > 0
        or spec.allowed_token_ids is not None
    )


def process(
    logits: torch.Tensor,
    specs: Sequence[SamplingSpec],
    histories: Sequence[Sequence[int] | None],
    positions: Sequence[int],
) -> torch.Tensor:
    """`logits` [S, V] with every row processed by its spec; rows whose spec
    asks for nothing are the input's. `positions[i]` is the number of tokens
    of row i's context (prompt and output so far); `histories[i]` those
    tokens when the spec needs them."""
    rows = [i for i, s in enumerate(specs) if processes(s)]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        out[i] = process_row(out[i], specs[i], histories[i], positions[i])
    return out


def process_row(
    row: torch.Tensor, spec: SamplingSpec, history: Sequence[int] | None, position: int
) -> torch.Tensor:
    """One row [V] processed by `spec` (a new tensor; `row` is not changed)."""
    row = row.clone()
    vocab, dev = row.shape[-1], row.device
    if spec.logit_bias is not None:
        ids = [t for t, _ in spec.logit_bias if t < vocab]
        bias = [b for t, b in spec.logit_bias if t < vocab]
        row.index_add_(0, _ids(ids, dev), torch.tensor(bias, dtype=row.dtype, device=dev))
    if spec.needs_history:
        if history is None:
            raise ValueError("the sampling rank has no token history for a penalized request")
        tokens = _ids(history, dev)
        output = tokens[spec.prompt_len :]
        if spec.repetition_penalty != 1 and len(tokens):
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[tokens] = True
            p = spec.repetition_penalty
            row = torch.where(seen, torch.where(row > 0, row / p, row * p), row)
        if (spec.frequency_penalty != 0 or spec.presence_penalty != 0) and len(output):
            counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
            row = row - spec.frequency_penalty * counts - spec.presence_penalty * (counts > 0)
        _ban_bad_words(row, spec, history[spec.prompt_len :])
    if spec.min_tokens_banned is not None and position - spec.prompt_len < spec.min_tokens:
        row[_ids([t for t in spec.min_tokens_banned if t < vocab], dev)] = float("-inf")
    if spec.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[_ids([t for t in spec.allowed_token_ids if t < vocab], dev)] = True
        row = row.masked_fill(~keep, float("-inf"))
    return row


def _ban_bad_words(row: torch.Tensor, spec: SamplingSpec, output: Sequence[int]) -> None:
    """vLLM's rule: a word's last token is banned where the output ends with
    the word's other tokens (a one-token word is always banned)."""
    if spec.bad_words is None:
        return
    banned = []
    for word in spec.bad_words:
        head = word[:-1]
        if len(head) > len(output):
            continue
        if not head or list(output[len(output) - len(head) :]) == head:
            banned.append(word[-1])
    banned = [t for t in banned if t < row.shape[-1]]
    if banned:
        row[_ids(banned, row.device)] = float("-inf")


def _ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64, device=device)
