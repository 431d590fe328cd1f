"""CPU sampling over the head of each row's order (`sample_candidates`)
against `sample_reference`, which sorts whole rows: the same tokens and the
same fallback flags, given the same noise."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.kernels import ops
from ringserve.kernels.sample_cpu import sample_candidates
from ringserve.kernels.sample_reference import kept_probs, sample_reference


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 10))
    vocab = draw(st.sampled_from([1, 2, 7, 64, 65, 300, 3000]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, vocab, generator=gen) * draw(st.sampled_from([0.05, 1.0, 4.0, 12.0]))
    for r in range(rows):  # rows the reference must fall back on, now and then
        odd = draw(st.sampled_from(["", "", "", "nan", "inf", "-inf row"]))
        col = draw(st.integers(0, vocab - 1))
        if odd == "nan":
            logits[r, col] = float("nan")
        elif odd == "inf":
            logits[r, col] = float("inf")
        elif odd == "-inf row":
            logits[r] = float("-inf")
    pick = lambda values: torch.tensor([draw(st.sampled_from(values)) for _ in range(rows)])  # noqa: E731
    temperature = pick([0.0, 0.2, 0.7, 1.0, 2.0, 1e-30])
    top_k = pick([0, 0, 1, 3, 40, vocab, vocab + 5])
    top_p = pick([1.0, 1.0, 0.95, 0.5, 0.999999, 0.01])
    min_p = pick([0.0, 0.0, 0.05, 0.5])
    noise = torch.rand(rows, vocab, generator=gen)
    return logits, temperature, top_k, top_p, min_p, noise, draw(st.sampled_from([1, 2, 64]))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_candidates_draw_the_reference_tokens(case) -> None:
    *args, first = case
    tokens, fallback = sample_candidates(*args, first=first)
    want_tokens, want_fallback = sample_reference(*args)
    assert tokens.dtype == torch.int64 and fallback.dtype == torch.bool
    assert tokens.tolist() == want_tokens.tolist()
    assert fallback.tolist() == want_fallback.tolist()


def test_flat_rows_widen_until_their_kept_tokens_end() -> None:
    # a nucleus of thousands of tokens: the first 64 candidates are all kept
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 20000, generator=gen) * 0.5
    params = (torch.full((6,), 1.0), torch.zeros(6, dtype=torch.int64), torch.full((6,), 0.9))
    noise = torch.rand(6, 20000, generator=gen)
    case = (logits, *params, torch.zeros(6), noise)
    assert kept_probs(*case[:5]).gt(0).sum(-1).min() > 1000
    assert sample_candidates(*case)[0].tolist() == sample_reference(*case)[0].tolist()
    assert ops.sample(*case)[0].tolist() == sample_reference(*case)[0].tolist()


def test_top_p_of_one_keeps_every_token() -> None:
    # three of these rows' running sums pass 1.0 by rounding before their
    # last tokens, which `excl < top_p` alone would drop
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 50000, generator=gen)
    probs = kept_probs(
        logits, torch.ones(4), torch.zeros(4, dtype=torch.int64), torch.ones(4), torch.zeros(4)
    )
    assert bool(probs.gt(0).all())


def test_ties_at_a_cut_keep_the_lowest_token_ids() -> None:
    # uniform rows and rows of tied maxima: which tied tokens a filter keeps
    # is the stable sort's choice (lowest ids first) on both paths
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 3000, generator=gen)
    logits[:3] = 1.0
    logits[3:, ::7] = 9.0
    noise = torch.rand(6, 3000, generator=gen)
    top_k = torch.tensor([5, 0, 100, 3, 0, 0])
    top_p = torch.tensor([1.0, 0.01, 1.0, 1.0, 0.3, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.9])
    case = (logits, torch.ones(6), top_k, top_p, min_p, noise)
    tokens = sample_candidates(*case)[0]
    assert tokens.tolist() == sample_reference(*case)[0].tolist()
    # uniform rows: top-k 5, top-p 0.01 (30 of 3000), top-k 100; tied maxima: top-k 3
    assert tokens[0] < 5 and tokens[1] < 30 and tokens[2] < 100 and tokens[3] in (0, 7, 14)


def test_a_rows_draw_is_the_same_whatever_shares_its_batch() -> None:
    # with two threads torch splits one long row's sum across them and rounds
    # it otherwise than inside a batch of rows: a race renormalised by that
    # sum drew 48112 here in a batch of two and 16188 alone
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(121)
        logits = torch.randn(2, 50000, generator=gen) * 2
        noise = torch.rand(2, 50000, generator=gen)
        noise[0, 48112] = 0.9995744228363037
        params = (torch.ones(2), torch.tensor([0, 50]), torch.ones(2), torch.zeros(2))
        for draw in (sample_candidates, sample_reference):
            together = draw(logits, *params, noise)[0].tolist()
            alone = [
                draw(logits[r : r + 1], *(p[r : r + 1] for p in params), noise[r : r + 1])[0].item()
                for r in range(2)
            ]
            assert together == alone, draw.__name__
        assert sample_candidates(logits, *params, noise)[0].tolist() == together
    finally:
        torch.set_num_threads(threads)


def test_half_precision_noise_draws_as_float32() -> None:
    logits = torch.tensor([[0.0, -200.0, -300.0]])
    noise = torch.full((1, 3), 0.999, dtype=torch.bfloat16)
    params = (torch.ones(1), torch.tensor([2]), torch.ones(1), torch.zeros(1))
    want = sample_reference(logits, *params, noise.float())[0]
    assert sample_candidates(logits, *params, noise)[0].tolist() == want.tolist()
    assert sample_reference(logits, *params, noise)[0].tolist() == want.tolist()
