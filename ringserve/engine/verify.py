"""Verification of speculative tokens on the last rank.

A verification row holds the last token and k proposals p1..pk; its k + 1
positions are all drawn through the sampler's per-row path, position j with
the request's seed at the position of the token it draws. Position j is
then judged against proposal p(j+1), in order:

* greedy rows accept while the target's token equals the proposal;
* sampled rows accept p with the target's probability of it (the proposals
  are deterministic, a one-point draft distribution), and on a rejection
  draw from the residual (the target's distribution without p), so every
  emitted token follows the target's distribution exactly.

The first rejection emits the residual (greedy: the target's) token; when
all k are accepted the draw at the last position is a k + 1-th token. Draws
are functions of the seed and the position, so a pass re-run after a void
verifies the same way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ringserve.engine import logits as processing
from ringserve.engine.grammar import apply_masks
from ringserve.engine.sampler import Sampler, noise_seed
from ringserve.kernels.sample_reference import NOISE_MAX, NOISE_MIN
from ringserve.ring.messages import Output, SamplingSpec

ACCEPT_SALT = 0x5DEECE66D  # the acceptance uniform's stream, apart from the draw's noise


@dataclass(frozen=True, slots=True)
class Verification:
    """One sampled entry: its spec, the position its first draw makes, and
    its proposals (empty for an ordinary row, which draws once)."""

    spec: SamplingSpec
    position: int
    proposals: list[int]
    history: list[int] | None = None  # the context before `position`, where processing needs it

    def histories(self) -> list[list[int] | None]:
        """The context of each of its draws: the history, then the proposals
        accepted before that position."""
        if self.history is None:
            return [None] * (len(self.proposals) + 1)
        return [self.history + self.proposals[:j] for j in range(len(self.proposals) + 1)]

    @property
    def greedy(self) -> bool:
        return self.spec.temperature == 0 or self.spec.top_k == 1


def accept_uniform(spec: SamplingSpec, position: int) -> float:
    """The uniform in [0, 1) that accepts or rejects the proposal at `position`."""
    return random.Random(noise_seed(spec.seed or 0, position) ^ ACCEPT_SALT).random()


class Verifier:
    """Stateless; draws through `sampler` so every position gets its row's processing."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        pass_id: int,
        logits: torch.Tensor,
        rows: list[Verification],
        masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Output:
        """`logits` holds len(proposals) + 1 rows per verification, in order;
        `masks` the grammar masks of the masked rows (by logits row), whose
        verifications carry no proposals."""
        raw = logits.float()
        specs = [v.spec for v in rows for _ in range(len(v.proposals) + 1)]
        positions = [v.position + j for v in rows for j in range(len(v.proposals) + 1)]
        histories = [h for v in rows for h in v.histories()]
        # Every position is judged on the logits its ordinary draw would see:
        # penalties and biases over its own context, proposals included.
        logits = processing.process(raw, specs, histories, positions)
        if masks is not None:
            logits = apply_masks(logits, *masks)
        drawn, fallback = self.sampler.draw(logits, specs, positions)
        drawn_l, fallback_l = drawn.tolist(), fallback.tolist()
        p_prop = self._proposal_probs(logits, rows)
        tokens: list[int] = []
        picked: list[int] = []  # the logits row of each emitted token
        accepted: list[int] = []
        at = 0
        for v in rows:
            emitted = self._judge(logits, v, at, drawn_l, fallback_l, p_prop)
            tokens += emitted
            picked += range(at, at + len(emitted))
            accepted.append(len(emitted))
            at += len(v.proposals) + 1
        idx = torch.tensor(picked, dtype=torch.int64, device=logits.device)
        chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        logprobs, top = self.sampler.logprobs(raw[idx], chosen, [specs[i] for i in picked])
        return Output(
            pass_id=pass_id,
            tokens=tokens,
            logprobs=logprobs,
            top_logprobs=top,
            fallbacks=int(fallback.sum()),
            accepted=accepted,
        )

    def _proposal_probs(self, logits: torch.Tensor, rows: list[Verification]) -> dict[int, float]:
        """The target's probability of each proposal of a sampled row, by logits row."""
        where, props, specs = [], [], []
        at = 0
        for v in rows:
            if not v.greedy:
                where += range(at, at + len(v.proposals))
                props += v.proposals
                specs += [v.spec] * len(v.proposals)
            at += len(v.proposals) + 1
        if not where:
            return {}
        idx = torch.tensor(where, dtype=torch.int64, device=logits.device)
        probs = self.sampler.probs(logits[idx], specs)
        p = probs.gather(-1, torch.tensor(props, device=logits.device)[:, None])[:, 0]
        return dict(zip(where, p.tolist(), strict=True))

    def _judge(
        self,
        logits: torch.Tensor,
        v: Verification,
        at: int,
        drawn: list[int],
        fallback: list[bool],
        p_prop: dict[int, float],
    ) -> list[int]:
        """The tokens one verification emits: its accepted proposals and one more."""
        emitted: list[int] = []
        for j, proposal in enumerate(v.proposals):
            row = at + j
            if v.greedy or fallback[row] or p_prop[row] != p_prop[row]:  # NaN: greedy fallback
                if drawn[row] != proposal:
                    return [*emitted, drawn[row]]
            elif accept_uniform(v.spec, v.position + j) >= p_prop[row]:
                return [*emitted, self._residual(logits[row], v, j, proposal)]
            emitted.append(proposal)
        return [*emitted, drawn[at + len(v.proposals)]]

    def _residual(self, logits: torch.Tensor, v: Verification, j: int, proposal: int) -> int:
        """A draw from the target's distribution at position j with the
        rejected proposal taken out: the exponential race over the others,
        with the noise the position's ordinary draw uses."""
        p = self.sampler.probs(logits[None], [v.spec])[0]
        p[proposal] = 0.0
        if not float(p.sum()) > 0:
            return proposal  # the target put all its mass on it: never rejected in exact arithmetic
        u = Sampler.noise(v.spec, v.position + j, p.shape[-1], p.device)
        race = p / -torch.log(u.clamp(min=NOISE_MIN, max=NOISE_MAX))
        return int(race.argmax())
