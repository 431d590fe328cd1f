"""Prompt logprobs on the last rank: for an entry whose request asks, the
log_softmax of the model's raw logits at every prompt position the entry
computes, judged against the prompt token that follows the position.

Stateless, so a pass re-run after a void (or a request re-prefilled after a
retraction) yields the same records: the spec carries the whole prompt, so
a chunk's last position is judged against the first token of the next chunk.
Costs nothing for a pass in which no request asks. Positions are judged
SLICE at a time, so the logits held at once (a few [SLICE, vocab] float
tensors) stay within those of the boot dry forward, which computes the
logits of max_batch rows (plan/audit.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringserve.engine.replica import Row
from ringserve.ring.messages import Decision, PromptLogprobs, TopLogprobs

SLICE = 16


def prompt_logprobs(
    decision: Decision,
    rows: list[Row],
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> list[PromptLogprobs] | None:
    """Records of the entries that ask for prompt logprobs (None when none
    does); `hidden` holds the pass's positions in entry order."""
    if all(r.sampling.prompt_logprobs is None for r in rows):
        return None
    records, offset = [], 0
    for e, r in zip(decision.entries, rows, strict=True):
        spec = r.sampling
        if spec.prompt_logprobs is not None and spec.prompt_token_ids is not None:
            prompt = spec.prompt_token_ids
            stop = min(e.start + len(e.tokens), len(prompt) - 1)  # positions with a next token
            if stop > e.start:
                at = hidden[offset : offset + stop - e.start]
                targets = prompt[e.start + 1 : stop + 1]
                k = spec.prompt_logprobs
                records.append(_judged(e.req_id, e.start + 1, at, targets, k, logits_of))
        offset += len(e.tokens)
    return records or None


def _judged(
    req_id: int,
    start: int,
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> PromptLogprobs:
    chosen: list[float] = []
    top: list[TopLogprobs] = []
    for at in range(0, len(targets), SLICE):
        logits = logits_of(hidden[at : at + SLICE]).float()
        lp = torch.log_softmax(torch.nan_to_num(logits, nan=float("-inf")), -1)
        idx = torch.tensor(targets[at : at + SLICE], dtype=torch.int64, device=lp.device)
        chosen += lp.gather(-1, idx[:, None])[:, 0].tolist()
        vals, ids = lp.topk(k, -1)
        top += [TopLogprobs(i, v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return PromptLogprobs(req_id, start, chosen, top)
