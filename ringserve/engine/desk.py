"""Rank 0's request desk: what callers hand in and get back. It turns a
prompt into a queued request with a handle, delivers each pass's new tokens
to the handles they belong to, and retires a handle once its request is
done. It keeps the serving metrics, counted where the events happen.

The desk bounds the queue: a request that finds `max_waiting` requests
waiting for their first admission is refused (`QueueFull`) before it is
numbered, so it leaves no trace; one still waiting `queue_timeout_s` after it came is aborted with
the reason, through the scheduler's abort, which the log records as an
input of the scheduler re-run (ringserve replay), so the re-run repeats it.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog

from ringserve import logs
from ringserve.engine.grammar import Grammars, GrammarStart
from ringserve.engine.handle import RequestHandle
from ringserve.engine.metrics import Metrics
from ringserve.engine.processing_params import processing_params
from ringserve.engine.textstream import TextStream
from ringserve.models.tokenizer import Tokenizer
from ringserve.params import SamplingParams
from ringserve.ring.messages import SamplingSpec
from ringserve.sched.request import Phase, Request, RequestFactory, sampling_spec
from ringserve.sched.scheduler import Scheduler

log = structlog.get_logger(__name__)

QUEUE_TIMEOUT = "queue timeout"  # begins the reason of a request that waited too long
RETRY_AFTER_S = 1  # what a refused caller is told to wait: passes finish in well under that


def carried(params: SamplingParams, prompt: list[int]) -> None:
    """Refuse, as a ValueError, parameters the ring's wire would refuse:
    the sampling rank decodes every request's spec by its type, and one it
    cannot decode would end the ring, not the request."""
    spec = sampling_spec(params, len(prompt), prompt=prompt)
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=SamplingSpec)
    except (msgspec.ValidationError, OverflowError, TypeError) as exc:
        raise ValueError(f"sampling parameters the ring cannot carry: {exc}") from None


class QueueFull(Exception):
    """The waiting queue is at its bound: come back later."""

    def __init__(self, waiting: int, limit: int) -> None:
        super().__init__(
            f"{waiting} requests are waiting for admission, the most this server queues is "
            f"{limit}; retry after {RETRY_AFTER_S} s"
        )
        self.retry_after_s = RETRY_AFTER_S


class RequestDesk:
    """Invariant: `handles` holds exactly the requests submitted and not yet
    retired; a handle gets every token of its request exactly once."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        new_request: RequestFactory,
        vocab_size: int,
        *,
        max_waiting: int | None = None,
        queue_timeout_s: float | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.new_request = new_request
        self.vocab_size = vocab_size
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self.grammars = grammars
        self.metrics = Metrics()
        self.handles: dict[int, RequestHandle] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._trace = logs.tracing()

    def submit(self, prompt: list[int], params: SamplingParams, stream_text: bool) -> RequestHandle:
        """Queue a request; raises ValueError for one that can never run and
        QueueFull while the queue is at its bound."""
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:  # it would fail the whole pass it rides in, others too
            raise ValueError(
                f"token id {bad} is outside the vocabulary of {self.vocab_size} tokens"
            )
        params = processing_params(
            params,
            self.tokenizer,
            self.vocab_size,
            self.scheduler.config.max_model_len,
            self.new_request.eos_ids,
        )
        carried(params, prompt)
        grammar = self._grammar(params)
        # the bound is on requests never admitted: a retracted one, back in
        # the queue, is work already taken on
        waiting = sum(not r.admitted for r in self.scheduler.waiting)
        if self.max_waiting is not None and waiting >= self.max_waiting:
            self.metrics.requests_rejected += 1
            log.info("request.rejected", waiting=waiting, limit=self.max_waiting)
            raise QueueFull(waiting, self.max_waiting)
        req = self.new_request(prompt, params)
        if grammar is not None:
            grammar.bind(req.req_id)
        self.scheduler.add(req)
        if self._trace:  # what a re-run of the scheduler needs (ringserve replay)
            log.debug(
                "request.arrival",
                req_id=req.req_id,
                prompt=req.prompt,
                params=params,
                seed=req.spec.seed,
            )
        handle = RequestHandle(
            req,
            TextStream(self.tokenizer, params.stop, stream_text, params.min_tokens),
            None if self.tokenizer is None else self.tokenizer.eos_token_id,
        )
        self.handles[req.req_id] = handle
        self.metrics.requests_total += 1
        self.metrics.prompt_tokens += len(prompt)
        if self.queue_timeout_s is not None:
            loop = asyncio.get_running_loop()
            self._timers[req.req_id] = loop.call_later(
                self.queue_timeout_s, self._expire, req.req_id
            )
        return handle

    def _grammar(self, params: SamplingParams) -> GrammarStart | None:
        """The compiled grammar of a constrained request (GrammarError, a
        ValueError, when it cannot compile)."""
        so = params.structured_outputs
        if so is None:
            return None
        if self.grammars is None:
            raise ValueError("structured_outputs are not available on this engine")
        return self.grammars.starter(so)

    def _expire(self, req_id: int) -> None:
        """The queue timeout of a request is up: abort it if it is still
        waiting and has produced nothing (one in flight or that has run is
        never dropped). Dropping a waiting request needs no pass woken: a
        queue that waits while nothing is in flight would have been admitted."""
        self._timers.pop(req_id, None)
        req = self.scheduler.requests.get(req_id)
        if req is None or req.phase is not Phase.WAITING or req.in_flight or req.output:
            return
        self.metrics.requests_timed_out += 1
        self.abort(
            req_id,
            f"error: {QUEUE_TIMEOUT}: still waiting for admission after "
            f"{self.queue_timeout_s:g} s ({len(self.scheduler.waiting)} waiting, "
            f"{len(self.scheduler.running)} running)",
        )

    def abort(self, req_id: int, reason: str) -> None:
        self.scheduler.abort(req_id, reason)
        req = self.scheduler.requests.get(req_id)
        self.deliver([] if req is None else [req])

    def deliver(self, touched: list[Request]) -> None:
        """Hand each touched request's new tokens to its handle."""
        now = time.monotonic()
        for req in touched:
            handle = self.handles.get(req.req_id)
            if handle is None or handle.done:
                continue
            delta = handle.advance(self.scheduler)
            if delta is None:
                continue
            if delta.token_ids:
                began = handle.last_token_at
                (self.metrics.ttft if began is None else self.metrics.tpot).observe(
                    now - (handle.submitted if began is None else began)
                )
                handle.last_token_at = now
            if handle.done:
                self._retire(handle)

    def _retire(self, handle: RequestHandle) -> None:
        req = handle.req
        self.metrics.cache_hit_tokens += req.cached_tokens
        self.metrics.e2e.observe(time.monotonic() - handle.submitted)
        self.metrics.prompt_lens.observe(len(req.prompt))
        self.metrics.output_lens.observe(len(req.output))
        reason = handle.finish_reason
        if reason and reason.startswith("error"):
            self.metrics.requests_failed += 1
        elif reason in ("stop", "length"):
            self.metrics.finished[reason] += 1
        else:  # vLLM's third reason; the label stays one of three
            self.metrics.finished["abort"] += 1
        timer = self._timers.pop(req.req_id, None)
        if timer is not None:
            timer.cancel()
        del self.handles[req.req_id]
        if self.grammars is not None:
            self.grammars.drop(req.req_id)
        self.scheduler.forget(req.req_id)

    def fail_all(self, reason: str) -> None:
        """The ring is broken: every live request ends with the reason."""
        for handle in list(self.handles.values()):
            req = handle.req
            req.in_flight = False
            self.scheduler.abort(req.req_id, f"error: {reason}")
            handle.take_new_tokens()
        if self.grammars is not None:
            for req_id in self.handles:
                self.grammars.drop(req_id)
        self.handles.clear()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
