"""Rank 0's scheduler: the only place a pass is decided (DESIGN §1, §3, §4),
composed of the request table, the pass book, the KV book, admission and
the relief ladder. Pure Python over ints. Given the same arrivals, outputs and voids in the
same order it makes the same decisions, so it can be re-run from logs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import structlog

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.census import Census, take_census
from ringserve.cache.radix import RadixCache
from ringserve.config import EngineConfig
from ringserve.ring.messages import Decision, Entry, Output, Void
from ringserve.sched.admission import Admission
from ringserve.sched.kvbook import KVBook
from ringserve.sched.passbook import Draft, Pass, PassBook
from ringserve.sched.prompt_logprobs import take_prompt_logprobs
from ringserve.sched.relief import Relief
from ringserve.sched.request import Phase, Request
from ringserve.sched.speculation import Speculator, constrained
from ringserve.sched.spill import seal_with_moves
from ringserve.sched.table import RequestTable

log = structlog.get_logger(__name__)


class PromptTooLong(ValueError):
    """A prompt this server can never run: longer than the context, or
    than the KV pool holds."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Budgets of one pass. `passes_in_flight` is the pipeline depth S, the
    most passes in flight; `busy_passes` of them (the ring's ranks, enough
    to keep every stage busy) are always open, and each one past them opens
    only once the live requests would fill half of it beyond full passes in
    the open ones (None: all S always open). The defaults are
    `EngineConfig`'s: build one with `from_engine`."""

    max_model_len: int
    max_tokens_per_pass: int
    chunk_size: int
    max_batch: int
    max_retries: int
    prefix_reuse: bool
    passes_in_flight: int
    speculative_tokens: int = 0  # the most proposals per decode step; 0: off
    ngram_max: int = 4
    ngram_min: int = 2
    speculative_adaptive: bool = True
    speculative_method: str = "ngram"  # or "draft": proposals offered by rank 0's draft model
    busy_passes: int | None = None

    def __post_init__(self) -> None:
        if min(self.max_tokens_per_pass, self.chunk_size, self.max_batch) < 1:
            raise ValueError("pass budgets must be >= 1")
        if self.passes_in_flight < 1 or self.max_retries < 0:
            raise ValueError("passes_in_flight must be >= 1 and max_retries >= 0")
        if self.busy_passes is not None and self.busy_passes < 1:
            raise ValueError("busy_passes must be >= 1")

    def open_slots(self, live: int) -> int:
        """How many passes may be in flight while `live` requests are: a
        pass past the busy ones is worth its stage time only when it carries
        requests that would otherwise wait (a thinner split of the same rows
        costs more per row, on a CPU, and saves nothing on a GPU)."""
        depth, busy = self.passes_in_flight, self.busy_passes or self.passes_in_flight
        if busy >= depth:
            return depth
        wanted = -(-(live - self.max_batch // 2) // self.max_batch)
        return max(busy, min(depth, wanted))

    @classmethod
    def from_engine(
        cls,
        config: EngineConfig,
        model_limit: int,
        passes_in_flight: int,
        busy_passes: int | None = None,
    ) -> SchedulerConfig:
        """The budgets `config` gives a model whose context is `model_limit`
        long. A context never outgrows the KV pool (one request alone must
        always fit it, or it could wait for ever): the context length is
        capped at the pool's usable slots."""
        limit = min(model_limit, config.kv_capacity_tokens - 1)
        if config.max_model_len is not None and config.max_model_len > limit:
            log.warning(
                "scheduler.max_model_len_capped",
                asked=config.max_model_len,
                model=model_limit,
                kv_slots=config.kv_capacity_tokens - 1,
                used=limit,
            )
        return cls(
            max_model_len=min(config.max_model_len or limit, limit),
            max_tokens_per_pass=config.max_tokens_per_pass,
            chunk_size=config.chunk_size,
            max_batch=config.max_batch,
            max_retries=config.max_retries,
            prefix_reuse=config.prefix_reuse,
            passes_in_flight=passes_in_flight,
            speculative_tokens=config.speculative_tokens,
            ngram_max=config.ngram_max,
            ngram_min=config.ngram_min,
            speculative_adaptive=config.speculative_adaptive,
            speculative_method=config.speculative or "ngram",
            busy_passes=busy_passes,
        )


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
        self.table = RequestTable()
        self.passes = PassBook(config.passes_in_flight)
        self.relief = Relief(self.kv, self.table)
        self.admission = Admission(
            self.table, self.kv, self.relief, config.chunk_size, config.max_batch
        )
        self.speculation = Speculator(
            config.speculative_tokens,
            config.ngram_max,
            config.ngram_min,
            config.speculative_adaptive,
            config.speculative_method,
        )
        self.voids = 0
        self.fallbacks = 0
        self.tokens_taken = 0  # output tokens requests kept (none past a stop in a verified run)

    @property
    def requests(self) -> dict[int, Request]:
        return self.table.requests

    @property
    def waiting(self) -> deque[Request]:
        return self.table.waiting

    @property
    def running(self) -> list[Request]:
        return self.table.running

    @property
    def in_flight(self) -> dict[int, Pass]:
        return self.passes.in_flight

    @property
    def next_pass_id(self) -> int:
        return self.passes.next_pass_id

    @property
    def idle(self) -> bool:
        return not self.table.live and not self.in_flight

    def add(self, req: Request) -> None:
        """Queue a request; ValueError for one that can never run."""
        n = len(req.prompt)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.config.max_model_len:
            raise PromptTooLong(
                f"prompt has {n} tokens; the model's context is {self.config.max_model_len}"
            )
        if n + 1 > self.allocator.capacity - 1:
            raise PromptTooLong(f"prompt of {n} tokens cannot fit the KV pool of this server")
        self.table.add(req)

    def abort(self, req_id: int, reason: str = "abort") -> None:
        log.info("request.abort", req_id=req_id, reason=reason)  # an input of the replay
        self._abort(req_id, reason)

    def _abort(self, req_id: int, reason: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.phase is Phase.FINISHED:
            return
        if req.in_flight:
            # applied when its pass returns; the first reason given stands
            req.abort_reason = req.abort_reason or reason
        else:
            self._finish(req, reason)

    def schedule(self) -> Decision | None:
        """Decide the next pass, or None when nothing can run now. A slot has
        at most one pass in flight, so up to S passes keep every stage busy.
        A pass takes idle requests (their previous pass has returned) up to
        an equal share of the live requests, so no pass runs fat behind a
        thin one: a request owns no slot, and the surplus of a fat pass
        rides in the next one."""
        open_slots = self.config.open_slots(self.table.live)
        if len(self.in_flight) >= open_slots:
            return None
        share = -(-self.table.live // open_slots)
        for slot in self.passes.free_slots():
            draft = Draft(self.config.max_tokens_per_pass, slot, share)
            self._extend_running(draft)
            self.admission.fill(draft)
            if draft.entries:
                return seal_with_moves(self.passes, self.cache, draft)
        return None

    def _extend_running(self, draft: Draft) -> None:
        for req in list(self.running):
            if not draft.has_room(self.config.max_batch):
                return
            if req.in_flight or req.phase is not Phase.RUNNING or not draft.takes(req):
                continue
            n = min(req.pending, self.config.chunk_size, draft.budget)
            proposal = self._proposal(req, draft) if n == req.pending == 1 else None
            k = 0 if proposal is None else len(proposal)
            slots = self.relief.alloc(n + k, draft, asker=req)
            if slots is not None:
                draft.add(req, slots, reuse=None, proposal=proposal)

    def _proposal(self, req: Request, draft: Draft) -> list[int] | None:
        """Speculative tokens for a decode step of `req`, within what the
        pass, the request's limits and the free slots leave (speculation
        never evicts or retracts); None when it proposes nothing."""
        if not self.speculation.on or not req.output or constrained(req):
            return None
        room = min(
            draft.budget - 1,
            req.params.max_tokens - len(req.output) - 1,
            self.config.max_model_len - len(req.prompt) - len(req.output) - 1,
            self.kv.available - 1,
        )
        if room < 1:
            return None
        return self.speculation.propose(req, room) or None

    def on_output(self, out: Output) -> list[Request]:
        """Apply one pass's sampled tokens; returns the requests it touched."""
        record = self.passes.settle(out.pass_id)
        self.cache.settle_moves(out.pass_id, confirmed=True)  # before inserts walk through them
        self.fallbacks += out.fallbacks
        counts = iter(out.accepted if out.accepted is not None else [1] * len(out.tokens))
        take_prompt_logprobs(record.reqs, out)
        at = 0
        for entry, req in zip(record.decision.entries, record.reqs, strict=True):
            req.retries, req.solo = 0, False  # the budget bounds consecutive voids
            stop = None
            if entry.sample:
                count = next(counts)
                stop = self._take_tokens(out.pass_id, req, entry, out, at, count)
                at += count
            elif req.prefilling and self.kv.shares(req):
                self.kv.insert(req)
            reason = req.abort_reason or stop
            if reason is not None:
                self._finish(req, reason)
        return record.reqs

    def _take_tokens(
        self, pass_id: int, req: Request, entry: Entry, out: Output, at: int, count: int
    ) -> str | None:
        """Take the entry's `count` tokens from `out.tokens[at:]` up to the
        first that ends the request; returns why it ends, if it does."""
        first = not req.output
        reason = None
        kept = 0
        while kept < count and reason is None:
            self._take_token(req, out, at + kept)
            kept += 1
            reason = req.stop_reason(self.config.max_model_len)
        if entry.draft:
            self.speculation.settle(pass_id, req, entry, count, kept, self.kv)
        if first and self.kv.shares(req):
            self.kv.insert(req)
        return reason

    def _take_token(self, req: Request, out: Output, i: int) -> None:
        self.tokens_taken += 1
        req.output.append(out.tokens[i])
        if out.logprobs is not None:
            req.logprobs.append(out.logprobs[i])
        if out.top_logprobs is not None:
            top = out.top_logprobs[i]
            req.top_logprobs.append(dict(zip(top.token_ids, top.logprobs, strict=True)))

    def on_void(self, void: Void) -> list[Request]:
        """Roll a voided pass back: free what it allocated, restore each
        request to its pre-pass state, requeue within the retry budget. A
        void of a pass of several requests charges none of them: each is
        retried alone, so a request whose own input breaks the forward
        spends its own retries, fails alone, and leaves the others whole."""
        record = self.passes.settle(void.pass_id)
        alone = len(record.reqs) == 1
        self.voids += 1
        log.warning("pass.void", pass_id=void.pass_id, void_rank=void.rank, reason=void.reason)
        for entry, req in reversed(list(zip(record.decision.entries, record.reqs, strict=True))):
            self.kv.roll_back(req, entry.start, entry.slots)
            if entry.reuse is not None:  # the pass admitted it: back to the queue
                self.kv.release(req)
                self.table.requeue(req)
            if alone:
                req.retries += 1
            else:
                req.solo = True
            if req.abort_reason or req.retries > self.config.max_retries:
                why = (
                    req.abort_reason
                    or f"error: pass {void.pass_id} void on rank {void.rank}: {void.reason}"
                )
                self._abort(req.req_id, why)
        self.cache.settle_moves(void.pass_id, confirmed=False)  # after its borrowers let go
        return record.reqs

    def _finish(self, req: Request, reason: str) -> None:
        if self.config.prefix_reuse and req.row and not reason.startswith(("abort", "error")):
            self.kv.insert(req)
        if req.phase is Phase.RUNNING:
            self.passes.drop(req.req_id)
        if req.node is not None:
            self.kv.release(req)
        self.speculation.forget(req.req_id)
        self.table.finish(req, reason)

    def forget(self, req_id: int) -> None:
        """Drop a finished request from the table once its result is delivered."""
        self.table.forget(req_id)

    def census(self) -> Census:
        held = sum(len(r.private) for r in self.running)
        return take_census(self.allocator, self.cache, held)
