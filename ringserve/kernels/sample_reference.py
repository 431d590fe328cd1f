"""Token sampling over a batch of logit rows: the torch reference.

Randomness enters only through `noise`, a tensor of uniforms in (0, 1) of the
logits' shape, so every backend given the same noise picks the same tokens.
A token is drawn by the exponential race: argmax(p / -log(u)), which samples
exactly from p. The kept probabilities race as they are, not renormalised:
dividing them all by their sum changes no argmax but its rounding, and how a
sum rounds depends on how the rows are batched (torch splits a long row's
sum across threads), so a row's draw would depend on what shares its pass.
Rows with temperature 0 are greedy.
"""

from __future__ import annotations

import torch

# Noise is clamped into [NOISE_MIN, NOISE_MAX] so -log(u) is finite and positive.
NOISE_MIN = 1e-20
NOISE_MAX = 1.0 - 1e-7


def tempered_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Softmax of each row at its temperature; rows with temperature <= 0
    (greedy) use 1 so their probabilities stay defined."""
    temp = torch.where(temperature > 0, temperature, 1.0)[:, None]
    return torch.softmax(logits / temp, dim=-1)


def kept_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Probabilities after temperature, with what top-k (k <= 0: off), top-p
    (>= 1: off) and min-p drop set to 0; not renormalised."""
    probs = tempered_probs(logits, temperature)
    # stable: equal probabilities in token order, so a filter's cut through
    # a tie keeps the same tokens on every backend and every run
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = kept_mask(sorted_p, top_k, top_p, min_p, probs.shape[-1])
    kept = torch.where(keep, sorted_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


def kept_mask(
    sorted_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    """Which of each row's most probable tokens (`sorted_p`, descending: a
    whole sorted row, or its head) the filters keep, always the first."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)[None, :]
    keep = rank < torch.where(top_k > 0, top_k, vocab)[:, None]
    # top-p at 1 keeps every token: the running sum may pass 1 by rounding
    keep &= ((sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]) | (top_p[:, None] >= 1)
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    return keep


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race's entries, probs / -log(u), the uniforms clamped
    so -log(u) is finite and positive."""
    return probs / -torch.log(noise.clamp(min=NOISE_MIN, max=NOISE_MAX))


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [S] int64, fallback [S] bool). A row whose
    probabilities hold NaN or inf falls back to argmax over its logits with
    NaN replaced by -inf, and is flagged rather than raised."""
    logits, noise = logits.float(), noise.float()
    kept = kept_probs(logits, temperature, top_k, top_p, min_p)
    # kept probabilities are finite and at most 1 unless the row is NaN
    bad = ~torch.isfinite(kept.sum(-1))
    sampled = torch.nan_to_num(race(kept, noise), nan=-1.0).argmax(-1)
    greedy = torch.nan_to_num(logits, nan=float("-inf")).argmax(-1)
    use_greedy = (temperature <= 0) | bad
    return torch.where(use_greedy, greedy, sampled), bad & (temperature > 0)
