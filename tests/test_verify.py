"""The last rank's verification of speculative tokens: sampled outputs
follow the target's distribution at every position (rejection sampling
against deterministic proposals), greedy rows accept exactly the agreeing
prefix, and the counts and logprobs line up with the emitted tokens."""

from __future__ import annotations

import torch

from ringserve.engine.sampler import Sampler
from ringserve.engine.verify import Verification, Verifier
from ringserve.ring.messages import SamplingSpec

VOCAB = 6
# Target distributions at the three positions of a k = 2 verification row.
TARGET = torch.tensor(
    [
        [0.10, 0.40, 0.05, 0.25, 0.15, 0.05],
        [0.30, 0.05, 0.10, 0.05, 0.50, 0.00],
        [0.05, 0.05, 0.60, 0.10, 0.10, 0.10],
    ]
)
PROPOSALS = [1, 4]  # p(1) = 0.4 at position 0, p(4) = 0.5 at position 1
TRIALS = 3000
# chi-square with 5 degrees of freedom exceeds 25.7 with probability 1e-4
CHI2_LIMIT = 25.7


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def run_sampled(trials: int = TRIALS) -> list[list[int]]:
    logits = torch.log(TARGET.clamp(min=1e-30)).repeat(trials, 1)
    rows = [
        Verification(SamplingSpec(temperature=1.0, seed=seed), 100, PROPOSALS)
        for seed in range(trials)
    ]
    out = Verifier(Sampler())(0, logits, rows)
    assert out.accepted is not None and sum(out.accepted) == len(out.tokens)
    emitted, at = [], 0
    for n in out.accepted:
        emitted.append(out.tokens[at : at + n])
        at += n
    return emitted


def test_sampled_verification_follows_the_target_distribution():
    emitted = run_sampled()
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).float()
    assert chi2(first, TARGET[0]) < CHI2_LIMIT, first
    after_one = [e[1] for e in emitted if e[0] == PROPOSALS[0]]
    second = torch.bincount(torch.tensor(after_one), minlength=VOCAB).float()
    assert chi2(second, TARGET[1]) < CHI2_LIMIT, second
    after_two = [e[2] for e in emitted if e[:2] == PROPOSALS]
    third = torch.bincount(torch.tensor(after_two), minlength=VOCAB).float()
    assert chi2(third, TARGET[2]) < CHI2_LIMIT, third
    # and the proposals were worth something: about 0.4 and 0.4 * 0.5 accepted
    assert 0.3 < len(after_one) / TRIALS < 0.5 and 0.13 < len(after_two) / TRIALS < 0.27


def test_sampled_verification_repeats_itself_for_the_same_seed():
    assert run_sampled(50) == run_sampled(50)


def test_greedy_verification_accepts_the_agreeing_prefix_and_one_more():
    logits = torch.log(TARGET.clamp(min=1e-30))  # argmax: 1, 4, 2
    greedy = SamplingSpec(temperature=0.0, logprobs=0)
    rows = [
        Verification(greedy, 10, [1, 4]),  # both agree: 1, 4 and the bonus 2
        Verification(greedy, 10, [1, 3]),  # the second disagrees: 1, then 4
        Verification(greedy, 10, [0, 4]),  # the first disagrees: 1 alone
        Verification(greedy, 10, []),  # an ordinary row of one position
    ]
    out = Verifier(Sampler())(7, torch.cat([logits, logits, logits, logits[:1]]), rows)
    assert out.pass_id == 7 and out.accepted == [3, 2, 1, 1]
    assert out.tokens == [1, 4, 2, 1, 4, 1, 1]
    expected = [TARGET[0, 1], TARGET[1, 4], TARGET[2, 2], TARGET[0, 1], TARGET[1, 4]]
    assert out.logprobs is not None
    assert torch.allclose(torch.tensor(out.logprobs[:5]), torch.log(torch.stack(expected)))
