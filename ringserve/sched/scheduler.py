"""Rank 0's scheduler: the only place a pass is decided (DESIGN §1, §3, §4).

Pure Python over ints. Given the same arrivals, outputs and voids in the
same order it makes the same decisions, so it can be re-run from logs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import structlog

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.census import Census, take_census
from ringserve.cache.radix import RadixCache
from ringserve.config import EngineConfig
from ringserve.ring.messages import Decision, Entry, NewRequest, Output, Void
from ringserve.sched.kvbook import KVBook
from ringserve.sched.request import Phase, Request

log = structlog.get_logger(__name__)

# A waiting request whose prompt shares at least this many more tokens with
# a prompt still being prefilled waits for that prefill to reach the cache.
SHARED_PREFIX_MIN = 16


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Budgets of one pass. `passes_in_flight` is the pipeline depth S. The
    defaults are `EngineConfig`'s: build one with `from_engine`."""

    max_model_len: int
    max_tokens_per_pass: int
    chunk_size: int
    max_batch: int
    max_retries: int
    prefix_reuse: bool
    passes_in_flight: int

    def __post_init__(self) -> None:
        if min(self.max_tokens_per_pass, self.chunk_size, self.max_batch) < 1:
            raise ValueError("pass budgets must be >= 1")
        if self.passes_in_flight < 1 or self.max_retries < 0:
            raise ValueError("passes_in_flight must be >= 1 and max_retries >= 0")

    @classmethod
    def from_engine(
        cls, config: EngineConfig, model_limit: int, passes_in_flight: int
    ) -> SchedulerConfig:
        """The budgets `config` gives a model whose context is `model_limit` long."""
        return cls(
            max_model_len=min(config.max_model_len or model_limit, model_limit),
            max_tokens_per_pass=config.max_tokens_per_pass,
            chunk_size=config.chunk_size,
            max_batch=config.max_batch,
            max_retries=config.max_retries,
            prefix_reuse=config.prefix_reuse,
            passes_in_flight=passes_in_flight,
        )


@dataclass(slots=True)
class _Pass:
    decision: Decision
    reqs: list[Request]


@dataclass(slots=True)
class _Draft:
    """A pass being assembled: its token budget and the requests in it."""

    budget: int
    slot: int = 0
    share: int = 1  # requests this pass may carry: an equal share of the live ones
    entries: list[Entry] = field(default_factory=list)
    reqs: list[Request] = field(default_factory=list)
    admitted: list[NewRequest] = field(default_factory=list)


class Scheduler:
    """Owns the request table, the slot allocator and the radix cache.

    Invariant (checked by `census`): every usable slot is free, cached, or
    private to exactly one live request."""

    def __init__(
        self, config: SchedulerConfig, allocator: SlotAllocator, cache: RadixCache
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.kv = KVBook(allocator, cache, config.prefix_reuse)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: dict[int, _Pass] = {}
        self.next_pass_id = 0
        self._next_slot = 0
        self._to_drop: list[int] = []
        self.voids = 0
        self.fallbacks = 0

    # ---- arrivals and aborts -------------------------------------------------

    def add(self, req: Request) -> None:
        n = len(req.prompt)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; the model's context is {self.config.max_model_len}"
            )
        if n + 1 > self.allocator.capacity - 1:
            raise ValueError(f"prompt of {n} tokens cannot fit the KV pool of this server")
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id} is already in use")
        self.requests[req.req_id] = req
        self.waiting.append(req)
        log.info("request.admitted", req=req.req_id, prompt_tokens=n)

    def abort(self, req_id: int, reason: str = "abort") -> None:
        log.info("request.abort", req_id=req_id, reason=reason)  # an input of the replay
        self._abort(req_id, reason)

    def _abort(self, req_id: int, reason: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.phase is Phase.FINISHED:
            return
        if req.in_flight:
            req.abort_reason = reason
        elif req.phase is Phase.WAITING:
            self.waiting.remove(req)
            self._finish(req, reason)
        else:
            self._finish(req, reason)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.in_flight

    # ---- deciding a pass -----------------------------------------------------

    def schedule(self) -> Decision | None:
        """Decide the next pass, or None when nothing can run now. A slot has
        at most one pass in flight, so up to S passes keep every stage busy.
        A pass takes idle requests (their previous pass has returned) up to
        an equal share of the live requests, so no pass runs fat behind a
        thin one: a request owns no slot, and the surplus of a fat pass
        rides in the next one."""
        if len(self.in_flight) >= self.config.passes_in_flight:
            return None
        busy = {p.decision.mb_slot for p in self.in_flight.values()}
        slots = self.config.passes_in_flight
        for k in range(slots):
            slot = (self._next_slot + k) % slots
            if slot in busy:
                continue
            draft = _Draft(budget=self.config.max_tokens_per_pass, slot=slot, share=self._share())
            self._extend_running(draft)
            self._admit_waiting(draft)
            if draft.entries:
                self._next_slot = (slot + 1) % slots
                return self._seal(draft)
        return None

    def _seal(self, draft: _Draft) -> Decision:
        decision = Decision(
            pass_id=self.next_pass_id,
            mb_slot=draft.slot,
            new_requests=draft.admitted,
            entries=draft.entries,
            dropped=self._to_drop,
        )
        self._to_drop = []
        self.next_pass_id += 1
        self.in_flight[decision.pass_id] = _Pass(decision, draft.reqs)
        for req in draft.reqs:
            req.in_flight = True
        return decision

    def _share(self) -> int:
        live = len(self.running) + len(self.waiting)
        return -(-live // self.config.passes_in_flight)

    def _room(self, draft: _Draft) -> bool:
        rows = min(self.config.max_batch, draft.share)
        return draft.budget > 0 and len(draft.entries) < rows

    def _extend_running(self, draft: _Draft) -> None:
        for req in list(self.running):
            if not self._room(draft):
                return
            if req.in_flight or req.phase is not Phase.RUNNING:
                continue
            n = min(req.pending, self.config.chunk_size, draft.budget)
            slots = self._alloc(n, draft, asker=req)
            if slots is not None:
                self._add_entry(draft, req, slots, reuse=None)

    def _admit_waiting(self, draft: _Draft) -> None:
        while self.waiting and self._room(draft):
            req = self.waiting[0]
            reuse, node = self.kv.match(req)
            if self._prefix_pending(req, len(reuse)):
                log.debug("request.deferred", req=req.req_id, cached=len(reuse))
                return
            n = min(len(req.tokens) - len(reuse), self.config.chunk_size, draft.budget)
            self.cache.lock(node)
            slots = self._alloc(n, draft, asker=None)
            if slots is None:
                self.cache.unlock(node)
                log.info("request.parked", req=req.req_id, needs=n)
                return
            self.waiting.popleft()
            req.phase, req.node, req.row = Phase.RUNNING, node, list(reuse)
            req.cached_tokens = max(req.cached_tokens, len(reuse))
            self.running.append(req)
            draft.admitted.append(NewRequest(req.req_id, req.spec))
            self._add_entry(draft, req, slots, reuse=reuse)

    def _prefix_pending(self, req: Request, cached: int) -> bool:
        """Whether a request whose prompt is not yet cached shares more of it than
        the cache holds: waiting one pass for its KV beats computing it twice."""
        if not self.config.prefix_reuse:
            return False
        tokens = req.tokens
        need = cached + SHARED_PREFIX_MIN
        for other in self.running:
            if not other.output and _common_prefix(other.prompt, tokens, need) >= need:
                return True
        return False

    def _add_entry(
        self, draft: _Draft, req: Request, slots: list[int], reuse: list[int] | None
    ) -> None:
        start = len(req.row)
        tokens = req.tokens[start : start + len(slots)]
        sample = len(slots) == req.pending
        draft.entries.append(Entry(req.req_id, start, tokens, slots, sample, reuse))
        draft.reqs.append(req)
        draft.budget -= len(slots)
        req.row.extend(slots)
        req.private.update(slots)

    # ---- relief ladder -------------------------------------------------------

    def _alloc(self, n: int, draft: _Draft, asker: Request | None) -> list[int] | None:
        """n slots, cheapest relief first: evict unlocked cache, then, for a
        running asker, retract the newest idle request (possibly the asker
        itself, which then waits); None means the asker waits or parks."""
        self.kv.evict_for(n)  # the cache logs asked and freed
        while asker is not None and n > self.allocator.available:
            victim = self._retract_candidate(draft)
            if victim is None:
                break
            self._retract(victim)
            if victim is asker:
                return None
        return self.kv.take(n)

    def _retract_candidate(self, draft: _Draft) -> Request | None:
        for req in reversed(self.running):
            if not req.in_flight and req not in draft.reqs:
                return req
        return None

    def _retract(self, req: Request) -> None:
        """Free a running request's KV and requeue it for re-prefill."""
        log.info("request.retracted", req=req.req_id, freed=len(req.private))
        self.kv.release(req)
        self.running.remove(req)
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    # ---- terminals -----------------------------------------------------------

    def on_output(self, out: Output) -> list[Request]:
        """Apply one pass's sampled tokens; returns the requests it touched."""
        record = self.in_flight.pop(out.pass_id)
        self.fallbacks += out.fallbacks
        sampled = iter(range(len(out.tokens)))
        for entry, req in zip(record.decision.entries, record.reqs, strict=True):
            req.in_flight = False
            req.retries = 0  # the budget bounds consecutive voids
            if entry.sample:
                self._take_token(req, out, next(sampled))
            elif self.config.prefix_reuse and req.prefilling:
                self.kv.insert(req)
            reason = req.abort_reason or (
                req.stop_reason(self.config.max_model_len) if entry.sample else None
            )
            if reason is not None:
                self._finish(req, reason)
        return record.reqs

    def _take_token(self, req: Request, out: Output, i: int) -> None:
        first = not req.output
        req.output.append(out.tokens[i])
        if out.logprobs is not None:
            req.logprobs.append(out.logprobs[i])
        if out.top_logprobs is not None:
            top = out.top_logprobs[i]
            req.top_logprobs.append(dict(zip(top.token_ids, top.logprobs, strict=True)))
        if first and self.config.prefix_reuse:
            self.kv.insert(req)

    def on_void(self, void: Void) -> list[Request]:
        """Roll a voided pass back: free what it allocated, restore each
        request to its pre-pass state, requeue within the retry budget."""
        record = self.in_flight.pop(void.pass_id)
        self.voids += 1
        log.warning("pass.void", pass_id=void.pass_id, void_rank=void.rank, reason=void.reason)
        for entry, req in reversed(list(zip(record.decision.entries, record.reqs, strict=True))):
            req.in_flight = False
            del req.row[entry.start :]
            self.allocator.free(entry.slots)
            req.private.difference_update(entry.slots)
            if entry.reuse is not None:
                self._unadmit(req)
            req.retries += 1
            if req.abort_reason or req.retries > self.config.max_retries:
                why = (
                    req.abort_reason
                    or f"error: pass {void.pass_id} void on rank {void.rank}: {void.reason}"
                )
                self._abort(req.req_id, why)
        return record.reqs

    def _unadmit(self, req: Request) -> None:
        self.kv.release(req)
        self.running.remove(req)
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: str) -> None:
        if self.config.prefix_reuse and req.row and not reason.startswith(("abort", "error")):
            self.kv.insert(req)
        if req.phase is Phase.RUNNING:
            self.running.remove(req)
            self._to_drop.append(req.req_id)
        if req.node is not None:
            self.kv.release(req)
        req.phase, req.finish_reason = Phase.FINISHED, reason
        log.info("request.finished", req=req.req_id, reason=reason, tokens=len(req.output))

    def forget(self, req_id: int) -> None:
        """Drop a finished request from the table once its result is delivered."""
        req = self.requests.pop(req_id)
        if req.phase is not Phase.FINISHED:
            raise ValueError(f"request {req_id} is still {req.phase.value}")

    # ---- accounting ----------------------------------------------------------

    def census(self) -> Census:
        held = sum(len(r.private) for r in self.running)
        return take_census(self.allocator, self.cache, held)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, counted up to `limit`."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
