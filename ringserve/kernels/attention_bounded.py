"""Paged attention through torch with a bounded working set, for the CPU.

`paged_attention_reference` copies every sequence's context K and V out of
the pool, padded to the longest, with a [B, Q, L] mask: a pass of a few
long contexts takes many times the memory of its own tokens (measured on
the ~100M Llama, float32: a 512-token chunk at a 16K context peaked at 115
MiB for four layers against 39 MiB planned). Here no copy holds more than
`limit` context tokens at once, `limit` being the largest pass's tokens,
which the planner charges (`plan/ledger.py`):

* sequences whose padded contexts fit `limit` together attend as one group
  through the reference;
* a longer sequence attends alone, over its context in tiles of at most
  `limit` tokens: the cached prefix in tiles every query sees whole, then
  the new tokens under a causal mask (queries and keys are the same tokens,
  so `is_causal` aligns), the tiles' outputs merged by their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.kernels.attention_reference import paged_attention_reference
from ringserve.kernels.batch import ForwardBatch, sub_batch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def paged_attention_bounded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    limit: int,
) -> torch.Tensor:
    """`paged_attention_reference`'s result ([T, Hq, D]) copying at most
    `limit` (>= 1) context tokens' K and V at once; the same bits where the
    whole batch fits."""
    steps = gather_steps(batch, limit)
    if steps is None:
        return paged_attention_reference(q, k_cache, v_cache, batch, scale)
    out = torch.empty_like(q)
    for step in steps:
        if isinstance(step, Alone):
            rows = slice(step.start, step.stop)
            out[rows] = _tiled(q[rows], k_cache, v_cache, step.slots, step.new, scale, limit)
        else:
            sub, rows = step
            out[rows] = paged_attention_reference(q[rows], k_cache, v_cache, sub, scale)
    return out


@dataclass(frozen=True, slots=True)
class Alone:
    """A sequence attended alone, in tiles: its query rows start:stop, its
    context's slots, its new tokens."""

    start: int
    stop: int
    slots: torch.Tensor
    new: int


Step = Alone | tuple[ForwardBatch, torch.Tensor]


def gather_steps(batch: ForwardBatch, limit: int) -> list[Step] | None:
    """How `batch` attends within `limit`: None when it fits whole, else
    groups of sequences (a sub-batch and its query rows) and sequences
    alone. Made once per pass and kept on the batch: every layer attends
    the same way."""
    if limit < 1:
        raise ValueError(f"a gather limit is at least one token, got {limit}")
    cached = batch.gather_plan
    if cached is not None and cached[0] == limit:
        return cached[1]
    lens = batch.seq_lens.tolist()
    steps: list[Step] | None = None
    if len(lens) * max(lens) > limit:
        steps = []
        starts, extends = batch.qo_indptr.tolist(), batch.extend_lens.tolist()
        group: list[int] = []
        widest = 0
        for b, n in enumerate(lens):
            if n > limit:
                slots = batch.req_slots[b, :n]
                steps.append(Alone(starts[b], starts[b + 1], slots, extends[b]))
                continue
            if group and (len(group) + 1) * max(widest, n) > limit:
                steps.append(sub_batch(batch, torch.tensor(group, dtype=torch.int64)))
                group, widest = [], 0
            group.append(b)
            widest = max(widest, n)
        if group:
            steps.append(sub_batch(batch, torch.tensor(group, dtype=torch.int64)))
    batch.gather_plan = (limit, steps)
    return steps


def _tiled(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    new: int,
    scale: float,
    limit: int,
) -> torch.Tensor:
    """One sequence's `new` queries ([new, Hq, D]) over its context `slots`
    (prefix then the new tokens' own), in tiles of at most `limit` keys."""
    qh = q.transpose(0, 1)[None]  # [1, Hq, new, D]
    prefix = slots.shape[0] - new
    tiles = [(s, min(s + limit, prefix), False) for s in range(0, prefix, limit)]
    tiles += [(s, min(s + limit, prefix + new), True) for s in range(prefix, prefix + new, limit)]
    acc = lse = None
    for start, stop, own in tiles:
        k = k_cache.index_select(0, slots[start:stop]).to(q.dtype).transpose(0, 1)[None]
        v = v_cache.index_select(0, slots[start:stop]).to(q.dtype).transpose(0, 1)[None]
        if own:  # queries new[first:] see keys new[first:stop]: causal from `first`
            first = start - prefix
            part, part_lse = _flash(qh[:, :, first:], k, v, 0.0, True, scale=scale)
            part = torch.cat((part.new_zeros(*part.shape[:2], first, part.shape[3]), part), 2)
            blank = part_lse.new_full((*part_lse.shape[:2], first), float("-inf"))
            part_lse = torch.cat((blank, part_lse), 2)
        else:
            part, part_lse = _flash(qh, k, v, 0.0, False, scale=scale)
        acc, lse = _merge(acc, lse, part.float(), part_lse)
    assert acc is not None
    return acc.to(q.dtype)[0].transpose(0, 1)


def _merge(
    acc: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted union of two attentions over disjoint keys, from
    their outputs [1, H, Q, D] and log-sum-exps [1, H, Q]."""
    if acc is None or lse is None:
        return part, part_lse
    both = torch.logaddexp(lse, part_lse)
    mine = torch.exp(lse - both).nan_to_num_(0.0)[..., None]
    theirs = torch.exp(part_lse - both).nan_to_num_(0.0)[..., None]
    return acc.mul_(mine).add_(part.mul_(theirs)), both
