"""A submitted request as its caller sees it: text deltas in order, the last
one carrying the finish reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ringserve.engine.textstream import TextStream
from ringserve.params import RequestOutput
from ringserve.sched.request import Phase, Request
from ringserve.sched.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class RequestHandle:
    """Invariant: every token of `req.output` is delivered in exactly one
    Delta, in order, and exactly one Delta has a finish reason (the last)."""

    def __init__(self, req: Request, stream: TextStream, eos_token_id: int | None = None) -> None:
        """`eos_token_id`: the tokenizer's own EOS, the one end `stop_reason`
        reports as None (the model's other EOS ids count as stop tokens)."""
        self.req = req
        self.stream = stream
        self.eos_token_id = eos_token_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.fed = 0
        self.submitted = time.monotonic()
        self.last_token_at: float | None = None
        self.done = False
        # where a stop string ended the text: tokens after it (brought by the
        # same pass, a verification's) are not the request's output
        self.stop_at: int | None = None
        # set once `result` waits: deltas are then no longer queued, and this
        # wakes it when the request ends
        self._awaited: asyncio.Future[None] | None = None

    @property
    def req_id(self) -> int:
        return self.req.req_id

    @property
    def kept(self) -> int:
        """How many of the request's tokens are its output."""
        return len(self.req.output) if self.stop_at is None else self.stop_at

    @property
    def finish_reason(self) -> str | None:
        """The request's, but `stop` where a stop string ended its text:
        the pass that brought the string's last token may also have reached
        max_tokens, which the scheduler saw first."""
        reason = self.req.finish_reason
        return "stop" if reason == "length" and self.stop_at is not None else reason

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's: the stop string or stop token id that ended the request;
        None for any other end, the tokenizer's EOS token included. As vLLM
        does, the model's other EOS ids (from its generation config, say)
        count as stop tokens; without a tokenizer every EOS id is an EOS."""
        if self.stream.stop_string is not None:
            return self.stream.stop_string if self.finish_reason == "stop" else None
        token = self._stop_token()
        eos = not self.req.params.ignore_eos and token in self.req.eos_ids
        return None if eos and self.eos_token_id in (None, token) else token

    def _stop_token(self) -> int | None:
        """The stop token id or EOS id that ended the request, if one did."""
        req, params = self.req, self.req.params
        if req.finish_reason != "stop" or not req.output or self.stream.stopped:
            return None
        last = req.output[-1]
        ends = last in params.stop_token_ids or (not params.ignore_eos and last in req.eos_ids)
        return last if ends else None

    def take_new_tokens(self) -> Delta | None:
        """Turn the request's new tokens into a Delta (None if nothing new)."""
        end = self.kept
        new = self.req.output[self.fed : end]
        finished = self.req.phase is Phase.FINISHED
        if not new and not finished:
            return None
        text = ""
        # A stop token (or EOS) that ends the request is in its ids, not its
        # text, as vLLM leaves it out.
        silent = len(new) - 1 if finished and self._stop_token() is not None else None
        for i, t in enumerate(new):  # a pass may bring several tokens: none past a stop string
            if i == silent:
                break
            text += self.stream.push(t)
            if self.stream.stopped:
                new, end = new[: i + 1], self.fed + i + 1
                self.stop_at = end
                break
        if finished:
            text += self.stream.finish()
        lp = self.req.logprobs[self.fed : end] if self.req.params.logprobs is not None else None
        top = self.req.top_logprobs[self.fed : end] if self.req.params.logprobs else None
        self.fed = end
        ended = (self.finish_reason, self.stop_reason) if finished else (None, None)
        delta = Delta(text, new, lp, top, *ended)
        self.done = finished
        if self._awaited is None:
            self.queue.put_nowait(delta)
        elif finished and not self._awaited.done():
            self._awaited.set_result(None)
        return delta

    def advance(self, scheduler: Scheduler) -> Delta | None:
        """Deliver new tokens; a stop string seen in the text ends the
        request on the scheduler (finish reason `stop`)."""
        delta = self.take_new_tokens()
        if delta is not None and self.stream.stopped and not self.done:
            scheduler.abort(self.req_id, "stop")
            self.take_new_tokens()
        return delta

    async def deltas(self) -> AsyncIterator[Delta]:
        while True:
            delta = await self.queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    async def result(self) -> RequestOutput:
        """The request's output once it has ended. It waits for the end
        alone: its caller is woken once, not once a token as a reader of
        `deltas` is (a handle is read one way or the other)."""
        if not self.done:
            self._awaited = asyncio.get_running_loop().create_future()
            self.queue = asyncio.Queue()  # what was queued is in the output too
            await self._awaited
        return self.output()

    def output(self) -> RequestOutput:
        req = self.req
        one = RequestOutput(
            request_id=req.req_id,
            prompt_token_ids=req.prompt,
            token_ids=req.output[: self.kept],
            text=self.stream.text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=req.logprobs[: self.kept] if req.params.logprobs is not None else None,
            top_logprobs=req.top_logprobs[: self.kept] if req.params.logprobs else None,
            cached_tokens=req.cached_tokens,
            prompt_logprobs=list(req.prompt_logprobs)
            if req.params.prompt_logprobs is not None
            else None,
        )
        return RequestOutput.of_choices(None, [one])
