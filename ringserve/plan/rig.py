"""One solve's inputs as integers, and the dynamic program over splits that
the planner's searches share (DESIGN §5)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from ringserve.plan.draft import DraftBytes
from ringserve.plan.ledger import Figure, RankLedger, total
from ringserve.plan.model_bytes import ModelBytes

INFEASIBLE = -(1 << 100)  # the headroom of a split the caps exclude: below any real one


@dataclass(frozen=True, slots=True)
class Rig:
    """One solve's inputs as integers. Invariant: the headroom of rank r
    holding layers [a, b) at capacity t is exactly
    spare[r] - (prefix[b] - prefix[a]) - t * (b - a) * kv, where spare[r] is
    the budget less the activations and less `fixed[r]`, the rank's share of
    embeddings and head: the one definition both the DP and the ledger use.
    `speeds[r]` is rank r's relative speed per layer (1 = the reference), as
    an exact fraction, so stage times compare without rounding.

    `caps`, where a method takes it, bounds the layers of each rank: a split
    giving rank r more than caps[r] layers counts as infeasible (headroom
    INFEASIBLE), which is how a bound on the slowest stage enters the DP.

    `draft`, with `--speculative draft`, is rank 0's draft model: rank 0's
    spare also loses its weights and activations, and its headroom
    t * draft.kv_per_token more (its pool holds the same t tokens)."""

    model: ModelBytes
    budgets: tuple[Figure, ...]
    activations: tuple[Figure, ...]
    prefix: tuple[int, ...]
    fixed: tuple[int, ...]
    speeds: tuple[Fraction, ...]
    draft: DraftBytes | None = None

    @classmethod
    def build(
        cls,
        model: ModelBytes,
        budgets: Sequence[Figure],
        acts: Sequence[Figure],
        speeds: Sequence[float] | None = None,
        draft: DraftBytes | None = None,
    ) -> Rig:
        ranks = len(budgets)
        prefix = [0]
        for layer in model.layers:
            prefix.append(prefix[-1] + layer.bytes)
        fixed = [0] * ranks
        fixed[0] += model.embed.bytes
        fixed[-1] += model.head.bytes - (model.tied if ranks == 1 else 0)
        exact = tuple(Fraction(s) for s in (speeds if speeds is not None else [1] * ranks))
        if len(exact) != ranks or min(exact) <= 0:
            raise ValueError(
                f"rank speeds {list(map(float, exact))} must be {ranks} positive factors"
            )
        return cls(model, tuple(budgets), tuple(acts), tuple(prefix), tuple(fixed), exact, draft)

    @property
    def ranks(self) -> int:
        return len(self.budgets)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def room(self, r: int, a: int, b: int, t: int) -> int:
        spare = self.budgets[r].bytes - self.activations[r].bytes - self.fixed[r]
        kv = t * (b - a) * self.model.kv_per_token_per_layer.bytes
        if r == 0 and self.draft is not None:
            spare -= self.draft.at(t).total
        return spare - (self.prefix[b] - self.prefix[a]) - kv

    def head_time(self, r: int) -> Fraction:
        """The head's part of rank r's stage, in reference-layer times: the
        last rank's alone."""
        return self.model.head_layers if r == self.ranks - 1 else Fraction(0)

    def stage_time(self, r: int, n: int) -> Fraction:
        """Rank r's time per pass holding n layers (and the head, on the
        last rank), in reference-layer times."""
        return (n + self.head_time(r)) / self.speeds[r]

    def caps_for(self, bottleneck: Fraction) -> tuple[int, ...]:
        """The most layers each rank may hold with no stage slower than
        `bottleneck` (0: none, which no split allows)."""
        return tuple(
            max(0, math.floor(bottleneck * s - self.head_time(r)))
            for r, s in enumerate(self.speeds)
        )

    def _ends(self, r: int, a: int, caps: tuple[int, ...] | None) -> range:
        """The ends b of rank r's slice [a, b): a layer left for each later
        rank, and no more than caps[r] layers."""
        last = self.num_layers - (self.ranks - 1 - r)
        if caps is not None:
            last = min(last, a + caps[r])
        return range(a + 1, last + 1)

    def _last_room(self, a: int, t: int, caps: tuple[int, ...] | None) -> int:
        if caps is not None and self.num_layers - a > caps[-1]:
            return INFEASIBLE
        return self.room(self.ranks - 1, a, self.num_layers, t)

    def best_split(
        self, t: int, caps: tuple[int, ...] | None = None
    ) -> tuple[int, tuple[int, ...]]:
        """The largest minimum headroom over all splits at capacity t (within
        caps), and the lexicographically smallest split that reaches it."""
        ranks, layers = self.ranks, self.num_layers
        best = self._suffix_best(t, caps)
        value, split, a = best[0][0], [], 0
        if value == INFEASIBLE:
            return value, ()
        for r in range(ranks - 1):
            b = next(
                b
                for b in self._ends(r, a, caps)
                if min(self.room(r, a, b, t), best[r + 1][b]) >= value
            )
            split.append(b - a)
            a = b
        split.append(layers - a)
        return value, tuple(split)

    def least_short(self, t: int, floor: int) -> tuple[int, ...]:
        """Of the splits at capacity t whose every rank keeps at least
        `floor` headroom (the best worst headroom there is, when no split
        fits), the first in lexicographic order of those whose summed
        shortfall is least: a refusal then names the rank that must have
        more, with no rank short that another split would leave whole."""
        ranks, layers = self.ranks, self.num_layers
        # least[r][a]: (summed shortfall of ranks r.. holding [a, L), end of rank r)
        least: list[list[tuple[int, int] | None]] = [[None] * (layers + 1) for _ in range(ranks)]
        for a in range(ranks - 1, layers):
            room = self.room(ranks - 1, a, layers, t)
            least[-1][a] = (max(0, -room), layers) if room >= floor else None
        for r in range(ranks - 2, -1, -1):
            for a in range(r, layers - (ranks - 1 - r)):
                for b in self._ends(r, a, None):
                    room, rest, best = self.room(r, a, b, t), least[r + 1][b], least[r][a]
                    if room < floor or rest is None:
                        continue
                    short = max(0, -room) + rest[0]
                    if best is None or short < best[0]:
                        least[r][a] = (short, b)
        split, a = [], 0
        for r in range(ranks):
            step = least[r][a]
            if step is None:
                raise ValueError(f"no split keeps every rank's headroom at {floor} or more")
            split.append(step[1] - a)
            a = step[1]
        return tuple(split)

    def _suffix_best(self, t: int, caps: tuple[int, ...] | None) -> list[list[int]]:
        """best[r][a]: the largest minimum headroom of ranks r.. holding
        layers [a, L), each rank at least one layer and at most its cap.
        Only starts a that leave a layer for every rank before and after are
        filled in."""
        ranks, layers = self.ranks, self.num_layers
        best = [[INFEASIBLE] * (layers + 1) for _ in range(ranks)]
        for a in range(ranks - 1, layers):
            best[-1][a] = self._last_room(a, t, caps)
        for r in range(ranks - 2, -1, -1):
            for a in range(r, layers - (ranks - 1 - r)):
                best[r][a] = max(
                    (min(self.room(r, a, b, t), best[r + 1][b]) for b in self._ends(r, a, caps)),
                    default=INFEASIBLE,
                )
        return best

    def ledger(self, split: tuple[int, ...], t: int) -> tuple[RankLedger, ...]:
        entries, a = [], 0
        kv = self.model.kv_per_token_per_layer
        for r, n in enumerate(split):
            parts = list(self.model.layers[a : a + n])
            parts += [self.model.embed] if r == 0 else []
            parts += [self.model.head] if r == self.ranks - 1 else []
            weights = Figure(
                self.fixed[r] + self.prefix[a + n] - self.prefix[a], total(parts).source
            )
            entries.append(
                RankLedger(
                    rank=r,
                    layers=range(a, a + n),
                    budget=self.budgets[r],
                    weights=weights,
                    kv=Figure(t * n * kv.bytes, kv.source),
                    activations=self.activations[r],
                    speed=float(self.speeds[r]),
                    head_time=float(self.head_time(r)),
                    draft=self.draft.at(t) if r == 0 and self.draft is not None else None,
                )
            )
            a += n
        return tuple(entries)

    def largest_pages(self, lo: int, hi: int, page_size: int, caps: tuple[int, ...] | None) -> int:
        """The most pages in [lo, hi] some split within caps fits, given that
        lo pages fit: headroom falls as T grows, so feasibility is monotone."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.best_split(mid * page_size, caps)[0] >= 0:
                lo = mid
            else:
                hi = mid - 1
        return lo
