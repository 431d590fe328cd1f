"""Speculative decoding on rank 0: which tokens a decode step proposes, how
many (adaptive k per request), and what a verification's result does to the
request's KV. Pure Python over ints, deterministic given the scheduler's
inputs, so `ringserve replay` re-runs it exactly.

A decode step with k proposals extends the row by k + 1 slots (the last
token and p1..pk); the last rank accepts a prefix of a tokens (1..k+1) and
the k + 1 - a slots past the kept context are freed here, with a receipt
in the log. A void frees all k + 1 like any other slots of the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from ringserve.ring.messages import Entry
from ringserve.sched.kvbook import KVBook
from ringserve.sched.ngram import NgramIndex
from ringserve.sched.request import Request

log = structlog.get_logger(__name__)

MAX_COOLDOWN = 32  # decode steps a request without accepted proposals waits, at most


@dataclass(slots=True)
class Lookahead:
    """One request's speculation: its n-gram index, the k it proposes now
    and, after proposals that all failed at k = 1, how many decode steps it
    skips before trying again (doubling up to MAX_COOLDOWN)."""

    k: int
    index: NgramIndex = field(default_factory=NgramIndex)
    cooldown: int = 0
    backoff: int = 0


@dataclass(slots=True)
class SpecStats:
    """Counters of every verification applied; `accepted_at[j]` counts
    verifications whose proposal j (0-based) was accepted."""

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    freed: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)


class Speculator:
    """Invariant: `lookahead` holds exactly the requests that proposed and
    have not been forgotten; k stays in 1..max_k."""

    def __init__(
        self, max_k: int, ngram_max: int, ngram_min: int, adaptive: bool, method: str = "ngram"
    ) -> None:
        self.max_k = max_k
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.adaptive = adaptive
        self.method = method
        self.lookahead: dict[int, Lookahead] = {}
        # a draft model's proposals, by request: (history length they follow, tokens)
        self.offers: dict[int, tuple[int, list[int]]] = {}
        self.stats = SpecStats(proposed_at=[0] * max_k, accepted_at=[0] * max_k)

    @property
    def on(self) -> bool:
        return self.max_k > 0

    def _state(self, req_id: int) -> Lookahead:
        state = self.lookahead.get(req_id)
        if state is None:
            state = self.lookahead[req_id] = Lookahead(self.max_k)
        return state

    def propose(self, req: Request, room: int) -> list[int]:
        """Tokens a decode step of `req` carries after its last token, at
        most `room` of them."""
        state = self._state(req.req_id)
        if state.cooldown > 0:
            state.cooldown -= 1
            return []
        k = min(state.k, room)
        if self.method == "draft":
            at, tokens = self.offers.pop(req.req_id, (-1, []))
            return tokens[:k] if at == len(req.prompt) + len(req.output) else []
        return state.index.propose(req.tokens, self.ngram_max, self.ngram_min, k)

    def asks(self, running: list[Request]) -> list[tuple[int, list[int], int]]:
        """What a draft model should propose for before the next pass:
        (req_id, history, k) of each idle decoding request that would take
        proposals and has none for its history."""
        out = []
        for req in running:
            if req.in_flight or req.pending != 1 or not req.output or constrained(req):
                continue
            state = self._state(req.req_id)
            n = len(req.prompt) + len(req.output)
            if state.cooldown == 0 and self.offers.get(req.req_id, (-1,))[0] != n:
                out.append((req.req_id, req.tokens, state.k))
        return out

    def offer(self, req_id: int, at: int, tokens: list[int]) -> None:
        """A draft model's proposal for request `req_id` after `at` tokens of history."""
        self.offers[req_id] = (at, list(tokens))

    def settle(
        self, pass_id: int, req: Request, entry: Entry, verified: int, kept: int, kv: KVBook
    ) -> None:
        """Apply a verification: `verified` tokens came back for the entry
        (its accepted proposals and one more), `kept` of them were taken
        (fewer when one of them ended the request). The row keeps the KV of
        the kept context; the other slots of the entry are freed."""
        k = entry.draft
        keep = entry.start + len(entry.tokens) - k + kept - 1
        rejected = req.row[keep:]
        kv.roll_back(req, keep, rejected)
        accepted = verified - 1
        self._count(k, accepted, len(rejected))
        state = self.lookahead.get(req.req_id)
        if state is not None and self.adaptive:
            self._adapt(state, k, accepted)
        log.info(
            "spec.verified",
            pass_id=pass_id,
            req=req.req_id,
            proposed=k,
            accepted=accepted,
            kept=kept,
            freed=len(rejected),
            next_k=None if state is None else state.k,
        )

    def _count(self, k: int, accepted: int, freed: int) -> None:
        s = self.stats
        s.verifications += 1
        s.proposed += k
        s.accepted += accepted
        s.freed += freed
        for j in range(k):
            s.proposed_at[j] += 1
        for j in range(accepted):
            s.accepted_at[j] += 1

    def _adapt(self, state: Lookahead, k: int, accepted: int) -> None:
        """All accepted: one more next time; otherwise as many as were
        accepted and one more. A request that keeps failing at k = 1 backs off."""
        if accepted == k:
            state.k = min(self.max_k, k + 1)
            state.backoff = 0
        elif accepted > 0 or k > 1:
            state.k = max(1, accepted + 1)
            state.backoff = 0
        else:
            state.backoff = min(MAX_COOLDOWN, 2 * state.backoff or 1)
            state.cooldown = state.backoff

    def forget(self, req_id: int) -> None:
        self.lookahead.pop(req_id, None)
        self.offers.pop(req_id, None)


def constrained(req: Request) -> bool:
    """Whether a grammar constrains `req`: its masks are filled by rank 0 for
    one position per pass, so its decode steps propose nothing."""
    return req.params.structured_outputs is not None
