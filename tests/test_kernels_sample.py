"""Triton sampling against `sample_reference`: given the same noise, the same
tokens and the same fallback flags, row by row."""

from __future__ import annotations

import pytest
import torch

from ringserve.kernels.layout import kernel_device
from ringserve.kernels.sample import sample
from ringserve.kernels.sample_reference import sample_reference, tempered_probs

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET is off and there is no CUDA device to run the kernels on",
)

VOCAB = 300  # three 128-wide blocks, the last one ragged


def mixed_params(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Per-row settings spanning greedy, each filter alone, all combined, none."""
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.1
    top_k = torch.randint(1, 40, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.6 + 0.4
    min_p = torch.rand(rows, generator=gen) * 0.3
    temperature[0::6] = 0.0
    top_k[1::6], top_p[1::6], min_p[1::6] = 0, 1.0, 0.0  # no filter at all
    top_k[2::6] = 0  # top-p and min-p only
    top_p[3::6], min_p[3::6] = 1.0, 0.0  # top-k only
    top_k[4::6], top_p[4::6] = 0, 1.0  # min-p only
    return tuple(t.to(DEVICE) for t in (temperature, top_k, top_p, min_p))


def logits_and_noise(rows: int, seed: int, scale: float = 4.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * scale
    noise = torch.rand(rows, VOCAB, generator=gen)
    return logits.to(DEVICE), noise.to(DEVICE)


def assert_same_draws(logits: torch.Tensor, params: tuple[torch.Tensor, ...], noise, block: int):
    tokens, fallback = sample(logits, *params, noise, block=block)
    expected_tokens, expected_fallback = sample_reference(logits, *params, noise)
    assert tokens.dtype == torch.int64 and fallback.dtype == torch.bool
    assert tokens.tolist() == expected_tokens.tolist()
    assert fallback.tolist() == expected_fallback.tolist()


@pytest.mark.parametrize("seed", [1, 2])
def test_sample_draws_the_reference_tokens(seed):
    logits, noise = logits_and_noise(24, seed)
    assert_same_draws(logits, mixed_params(24, seed + 10), noise, block=128)


def test_sample_draws_the_reference_tokens_from_flat_distributions():
    # Scaled-down logits keep many tokens near the top-p and min-p cut-offs.
    logits, noise = logits_and_noise(24, seed=3, scale=0.3)
    assert_same_draws(logits, mixed_params(24, seed=13), noise, block=128)


def test_sample_cuts_each_filter_at_its_boundary():
    # Probabilities 0.4, 0.3, 0.2, 0.1 on tokens 5, 9, 2, 7. Each filter keeps
    # tokens 5 and 9 only: top-p 0.65 keeps the token that crosses it, top-k 2,
    # min-p 0.6 (threshold 0.24). Noise near 1 makes one token win if kept.
    logits = torch.full((6, VOCAB), -1e4)
    logits[:, [5, 9, 2, 7]] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    noise = torch.full((6, VOCAB), 0.5)
    noise[0::2, 9] = noise[1::2, 2] = 1.0 - 1e-9
    temperature = torch.ones(6)
    top_k = torch.tensor([0, 0, 2, 2, 0, 0])
    top_p = torch.tensor([0.65, 0.65, 1.0, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.6, 0.6])
    params = tuple(t.to(DEVICE) for t in (temperature, top_k, top_p, min_p))
    logits, noise = logits.to(DEVICE), noise.to(DEVICE)
    tokens, _ = sample(logits, *params, noise, block=128)
    assert tokens.tolist() == [9, 5, 9, 5, 9, 5]
    assert_same_draws(logits, params, noise, block=128)


def test_sample_breaks_ties_as_the_reference_does():
    logits, noise = logits_and_noise(6, seed=4)
    logits[:3] = 1.0  # a uniform row: the sort's tie order decides top-k
    logits[3:, 17] = logits[3:, 250] = 30.0  # two equal maxima
    noise[:, :] = 0.5  # equal draws: the race ties too
    params = mixed_params(6, seed=14)
    assert_same_draws(logits, params, noise, block=128)


def test_sample_falls_back_to_argmax_on_non_finite_rows():
    logits, noise = logits_and_noise(6, seed=5)
    logits[0] = float("nan")
    logits[1, 40] = float("nan")
    logits[2, 99] = float("inf")
    logits[3] = float("-inf")
    logits[4, 7] = float("nan")  # greedy row: argmax skips the NaN, no fallback
    temperature = torch.tensor([0.8, 0.8, 0.8, 0.8, 0.0, 0.8], device=DEVICE)
    top_k = torch.tensor([0, 5, 0, 0, 0, 0], device=DEVICE)
    ones, zeros = torch.ones(6, device=DEVICE), torch.zeros(6, device=DEVICE)
    params = (temperature, top_k, ones * 0.9, zeros)
    assert_same_draws(logits, params, noise, block=128)
    _, fallback = sample(logits, *params, noise, block=128)
    assert fallback.tolist() == [True, True, True, True, False, False]


def test_sample_matches_reference_on_bfloat16_logits():
    logits, noise = logits_and_noise(12, seed=6)
    params = mixed_params(12, seed=16)
    assert_same_draws(logits.to(torch.bfloat16), params, noise, block=512)


def test_sample_rejects_noise_of_another_shape():
    logits, noise = logits_and_noise(2, seed=7)
    with pytest.raises(ValueError, match="noise has shape"):
        sample(logits, *mixed_params(2, seed=17), noise[:, :10])


def test_sample_keeps_every_token_at_top_p_one():
    # rows whose running sums pass 1.0 by rounding before their last tokens
    # (see test_sample_cpu): a top-p of 1 still keeps them, as the reference
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 50000, generator=gen)
    noise = torch.rand(4, 50000, generator=gen)
    noise[:, :] = 0.5
    ones, zeros = torch.ones(4), torch.zeros(4)
    probs = tempered_probs(logits, ones)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    noise.scatter_(-1, order[:, -1:], 1.0 - 1e-7)  # the least likely token wins if kept
    params = tuple(t.to(DEVICE) for t in (ones, zeros.long(), ones, zeros))
    tokens, _ = sample(logits.to(DEVICE), *params, noise.to(DEVICE), block=4096)
    assert (
        tokens.tolist()
        == sample_reference(logits, ones, zeros.long(), ones, zeros, noise)[0].tolist()
    )
