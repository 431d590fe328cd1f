"""Token sampling on the GPU (reference: `sample_reference`).

What is torch and what is kernel: the tempered softmax and the descending
sort run as torch ops, the very calls the reference makes, so the ordering
(ties included) is the reference's own. One Triton program per row then does
the rest over the sorted row: top-k / top-p / min-p filter, the exponential
race of the kept probabilities (unnormalised, as the reference's) against the
row's noise, the NaN/inf check and the argmax fallback over the raw logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.layout import require, require_inner_contiguous, require_same_device
from ringserve.kernels.sample_reference import NOISE_MAX, NOISE_MIN, tempered_probs

# Kernels may only read globals that are constexpr.
FLOAT_MAX = tl.constexpr(3.4028234663852886e38)  # nan_to_num's stand-in for inf
U_MIN = tl.constexpr(NOISE_MIN)
U_MAX = tl.constexpr(NOISE_MAX)


@triton.jit
def _keep(rank, p, excl_cumsum, top_k, top_p, threshold, VOCAB: tl.constexpr):
    keep = (rank < top_k) & (excl_cumsum < top_p) & (p >= threshold)
    return (keep | (rank == 0)) & (rank < VOCAB)


@triton.jit
def _greedy(logits, row, stride_l, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """First index of the max over the row, ranked as torch.nan_to_num(nan=-inf)
    ranks it: NaN lowest, -inf and +inf as the extreme finite floats."""
    best = float("-inf")
    best_tok = 0
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits + row * stride_l + cols, mask=cols < VOCAB).to(tl.float32)
        x = tl.where(x == float("inf"), FLOAT_MAX, x)
        x = tl.where(x == float("-inf"), -FLOAT_MAX, x)
        x = tl.where((x != x) | (cols >= VOCAB), float("-inf"), x)
        blk_best = tl.max(x, 0)
        blk_tok = start + tl.argmax(x, 0, tie_break_left=True)
        # Strictly greater: an earlier block wins a tie, as torch.argmax does.
        take = blk_best > best
        best_tok = tl.where(take, blk_tok, best_tok)
        best = tl.where(take, blk_best, best)
    return best_tok


@triton.jit
def _kept_mass(p_row, top_k, top_p, threshold, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of the sorted probabilities the filters keep."""
    total = 0.0
    carry = 0.0
    for start in range(0, VOCAB, BLOCK):
        rank = start + tl.arange(0, BLOCK)
        p = tl.load(p_row + rank, mask=rank < VOCAB, other=0.0)
        # Exclusive cumsum spelt as the reference spells it: inclusive minus p.
        excl = carry + tl.cumsum(p, 0) - p
        keep = _keep(rank, p, excl, top_k, top_p, threshold, VOCAB)
        total += tl.sum(tl.where(keep, p, 0.0), 0)
        carry += tl.sum(p, 0)
    return total


@triton.jit
def _race(
    p_row,
    order_row,
    noise_row,
    top_k,
    top_p,
    threshold,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Token winning the exponential race argmax(p / -log(u)) among the kept
    ones, unnormalised as the reference's; noise is read only for kept tokens."""
    best = -1.0
    best_tok = tl.zeros([], tl.int64) + VOCAB
    carry = 0.0
    for start in range(0, VOCAB, BLOCK):
        rank = start + tl.arange(0, BLOCK)
        p = tl.load(p_row + rank, mask=rank < VOCAB, other=0.0)
        excl = carry + tl.cumsum(p, 0) - p
        keep = _keep(rank, p, excl, top_k, top_p, threshold, VOCAB)
        carry += tl.sum(p, 0)
        tok = tl.load(order_row + rank, mask=keep, other=VOCAB)
        u = tl.load(noise_row + tok, mask=keep, other=0.5)
        u = tl.minimum(tl.maximum(u, U_MIN), U_MAX)
        race = tl.where(keep, p / -tl.log(u), -1.0)
        blk_best = tl.max(race, 0)
        # Among equal draws the lowest token id wins, as in the reference's argmax.
        blk_tok = tl.min(tl.where(keep & (race == blk_best), tok, VOCAB), 0)
        take = (blk_best > best) | ((blk_best == best) & (blk_tok < best_tok))
        best_tok = tl.where(take, blk_tok, best_tok)
        best = tl.where(take, blk_best, best)
    return best_tok


@triton.jit
def _sample_kernel(
    logits,
    sorted_p,
    order,
    noise,
    temperature,
    top_k,
    top_p,
    min_p,
    tokens,
    fallback,
    stride_l,
    stride_p,
    stride_o,
    stride_n,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_row = sorted_p + row * stride_p
    temp = tl.load(temperature + row).to(tl.float32)
    k = tl.load(top_k + row).to(tl.int64)
    k = tl.where(k > 0, k, VOCAB)
    tp = tl.load(top_p + row).to(tl.float32)
    tp = tl.where(tp >= 1.0, float("inf"), tp)  # top-p at 1 keeps all, whatever the rounding
    threshold = tl.load(min_p + row).to(tl.float32) * tl.load(p_row)
    total = _kept_mass(p_row, k, tp, threshold, VOCAB, BLOCK)
    # Kept probabilities are finite and non-negative unless the row is NaN,
    # and the first is positive: a finite, positive total is a sound row.
    bad = (total != total) | (total == float("inf")) | (total == 0.0)
    order_row, noise_row = order + row * stride_o, noise + row * stride_n
    drawn = _race(p_row, order_row, noise_row, k, tp, threshold, VOCAB, BLOCK)
    greedy = _greedy(logits, row, stride_l, VOCAB, BLOCK)
    use_greedy = (temp <= 0) | bad
    tl.store(tokens + row, tl.where(use_greedy, greedy, drawn).to(tl.int64))
    tl.store(fallback + row, (bad & (temp > 0)).to(tl.int8))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
    *,
    block: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `sample_reference`: `logits` and `noise` [S, V], the
    per-row parameters [S]. Returns (tokens [S] int64, fallback [S] bool)."""
    _check(logits, temperature, top_k, top_p, min_p, noise, block)
    rows, vocab = logits.shape
    probs = tempered_probs(logits.float(), temperature)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    noise = noise.float()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    fallback = torch.empty(rows, dtype=torch.int8, device=logits.device)
    if rows > 0:
        _sample_kernel[(rows,)](
            logits,
            sorted_p,
            order,
            noise,
            temperature,
            top_k,
            top_p.float(),
            min_p.float(),
            tokens,
            fallback,
            logits.stride(0),
            sorted_p.stride(0),
            order.stride(0),
            noise.stride(0),
            VOCAB=vocab,
            BLOCK=block,
        )
    return tokens, fallback.bool()


def _check(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
    block: int,
) -> None:
    require(logits.dim() == 2, f"logits must be [S, V], has shape {tuple(logits.shape)}")
    require(logits.is_floating_point(), f"logits must be floating point, are {logits.dtype}")
    require(tuple(noise.shape) == tuple(logits.shape), f"noise has shape {tuple(noise.shape)}")
    require_inner_contiguous(logits, "logits")
    require_inner_contiguous(noise, "noise")
    rows = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        require(tuple(t.shape) == (rows,), f"{name} has shape {tuple(t.shape)}, expected ({rows},)")
    require(tuple(min_p.shape) == (rows,), f"min_p has shape {tuple(min_p.shape)}")
    require(not top_k.is_floating_point(), f"top_k must be an integer tensor, is {top_k.dtype}")
    require(block >= 16 and block & (block - 1) == 0, f"block {block}: power of 2 >= 16")
    require_same_device(
        {"logits": logits, "noise": noise, "temperature": temperature, "top_k": top_k}
    )
