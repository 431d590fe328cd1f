"""Rank 0's request desk: what callers hand in and get back. It turns a
prompt into a queued request with a handle, delivers each pass's new tokens
to the handles they belong to, and retires a handle once its request is
done. It keeps the serving metrics, counted where the events happen."""

from __future__ import annotations

import time

import structlog

from ringserve import logs
from ringserve.engine.handle import RequestHandle
from ringserve.engine.metrics import Metrics
from ringserve.engine.textstream import TextStream
from ringserve.models.tokenizer import Tokenizer
from ringserve.params import SamplingParams
from ringserve.sched.request import Request, RequestFactory
from ringserve.sched.scheduler import Scheduler

log = structlog.get_logger(__name__)


class RequestDesk:
    """Invariant: `handles` holds exactly the requests submitted and not yet
    retired; a handle gets every token of its request exactly once."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        new_request: RequestFactory,
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.new_request = new_request
        self.vocab_size = vocab_size
        self.metrics = Metrics()
        self.handles: dict[int, RequestHandle] = {}
        self._trace = logs.tracing()

    def submit(self, prompt: list[int], params: SamplingParams, stream_text: bool) -> RequestHandle:
        """Queue a request; raises ValueError for one that can never run."""
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:  # it would fail the whole pass it rides in, others too
            raise ValueError(f"token id {bad} is outside the vocabulary of {self.vocab_size} tokens")
        req = self.new_request(prompt, params)
        self.scheduler.add(req)
        if self._trace:  # what a re-run of the scheduler needs (ringserve replay)
            log.debug(
                "request.arrival", req_id=req.req_id, prompt=req.prompt, params=params, seed=req.spec.seed
            )
        handle = RequestHandle(req, TextStream(self.tokenizer, params.stop, stream_text))
        self.handles[req.req_id] = handle
        self.metrics.requests_total += 1
        self.metrics.prompt_tokens += len(prompt)
        return handle

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
        if req.finish_reason and req.finish_reason.startswith("error"):
            self.metrics.requests_failed += 1
        del self.handles[req.req_id]
        self.scheduler.forget(req.req_id)

    def fail_all(self, reason: str) -> None:
        """The ring is broken: every live request ends with the reason."""
        for handle in list(self.handles.values()):
            req = handle.req
            req.in_flight = False
            self.scheduler.abort(req.req_id, f"error: {reason}")
            handle.take_new_tokens()
        self.handles.clear()
