"""Verification of speculative tokens on the last rank.

A verification row holds the last token and k proposals p1..pk; its k + 1
positions are all drawn through the sampler's per-row path, position j with
the request's seed at the position of the token it draws: the very draw an
ordinary pass makes there. Position j then accepts proposal p(j+1) exactly
when its draw is that token, and the first draw that is not emits itself;
when all k are accepted the draw at the last position is a k + 1-th token.

For greedy rows that is the agreeing prefix. For sampled rows it is the
coupled form of rejection sampling against deterministic (one-point)
proposals: a proposal is accepted with the target's probability of it, and
a rejected position emits a draw from the target without it, so every
emitted token follows the target's distribution, as before; and since each
emitted token is the position's ordinary draw, a seeded request's output is
the one it would have without speculation, whatever else shares its passes
(how many tokens a pass proposes depends on its room). Draws are functions
of the seed and the position, so a pass re-run after a void verifies alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.engine import logits as processing
from ringserve.engine.grammar import apply_masks
from ringserve.engine.sampler import Sampler
from ringserve.ring.messages import Output, SamplingSpec


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
        drawn_l = drawn.tolist()
        tokens: list[int] = []
        picked: list[int] = []  # the logits row of each emitted token
        accepted: list[int] = []
        at = 0
        for v in rows:
            emitted = _judge(v, drawn_l[at : at + len(v.proposals) + 1])
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


def _judge(v: Verification, drawn: list[int]) -> list[int]:
    """The tokens one verification emits, from its positions' draws: the
    proposals its draws agree with, then the first draw that does not (or
    the draw after the last proposal)."""
    for j, proposal in enumerate(v.proposals):
        if drawn[j] != proposal:
            return [*v.proposals[:j], drawn[j]]
    return [*v.proposals, drawn[len(v.proposals)]]
