"""The engine requests behind one HTTP request, and their lifetime.

A caller that goes away must not leave its requests running: they hold KV
slots and batch places. Three ways it can go, all ending in `close`, which
aborts whatever has not finished: a stream write fails, the handler is
cancelled (aiohttp's `handler_cancellation`), or, while the handler is
waiting on the engine and writing nothing, the watcher sees the connection
closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from ringserve.engine.conductor import Conductor
from ringserve.engine.desk import QUEUE_TIMEOUT, QueueFull
from ringserve.engine.grammar import GRAMMAR_FAILED
from ringserve.engine.handle import Delta, RequestHandle
from ringserve.http.errors import ApiError, bad_request
from ringserve.http.responses import PromptTokensDetails, Usage
from ringserve.params import RequestOutput, SamplingParams
from ringserve.sched.scheduler import PromptTooLong

SHUTTING_DOWN = "the server is shutting down"  # the end of requests cut off by a stop

log = structlog.get_logger(__name__)

WATCH_INTERVAL_S = 0.1


# Fields whose token ids the desk checks against the vocabulary.
_PARAMS_CHECKED_AT_SUBMIT = frozenset(
    {"logit_bias", "allowed_token_ids", "bad_words", "stop_token_ids", "stop"}
)


class Submission:
    """`len(prompts) * len(params)` choices; choice `p * len(params) + i` is
    prompt p sampled with params[i]. Invariant: once closed, every one of
    its requests has finished or has been aborted."""

    def __init__(
        self,
        conductor: Conductor,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        request: web.BaseRequest | None = None,
        prompt_param: str = "prompt",
        grammar_param: str = "structured_outputs",
    ) -> None:
        self.conductor = conductor
        self.prompts = prompts
        self.params = params
        self.request = request
        self.prompt_param = prompt_param
        self.grammar_param = grammar_param
        self.handles: list[RequestHandle] = []
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> Submission:
        await self.prepare()
        self.start()
        return self

    async def prepare(self) -> None:
        """Compile the choices' grammars off the event loop (cached); a 400
        naming the field when one cannot compile."""
        try:
            await self.conductor.prepare(self.params)
        except ValueError as exc:
            raise bad_request(str(exc), param=self.grammar_param) from None

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Submit every choice, or none: a refusal aborts those already in."""
        choices, limit = len(self.prompts) * len(self.params), self.conductor.desk.max_waiting
        if choices > limit:  # it could never be queued whole: retrying cannot help
            raise bad_request(
                f"this request asks for {choices} choices (prompts x n); the server queues at "
                f"most {limit} (--max-waiting-requests): lower n or send fewer prompts",
                param="n",
            )
        try:
            for prompt in self.prompts:
                for sp in self.params:
                    self.handles.append(self.conductor.submit(prompt, sp))
        except ValueError as exc:
            self.abort()
            first = str(exc).split(" ", 1)[0]
            param = first if first in _PARAMS_CHECKED_AT_SUBMIT else self.prompt_param
            code = "context_length_exceeded" if isinstance(exc, PromptTooLong) else None
            raise bad_request(str(exc), param=param, code=code) from None
        except QueueFull as exc:
            self.abort()
            raise rate_limited(exc) from None
        except RuntimeError as exc:
            self.abort()
            raise ApiError(503, f"the engine cannot take requests: {exc}") from None
        if self.request is not None:
            self._watcher = asyncio.create_task(self._watch(self.request))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) of every choice, as they arrive."""
        queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, h, queue)) for i, h in enumerate(self.handles)]
        try:
            live = len(self.handles)
            while live:
                i, delta = await queue.get()
                live -= delta.finish_reason is not None
                yield i, delta
        finally:
            for task in pumps:
                task.cancel()

    async def outputs(self) -> list[RequestOutput]:
        """Every choice's result, in choice order, once all have finished."""
        return list(await asyncio.gather(*(h.result() for h in self.handles)))

    def usage(self, generated: bool = True) -> Usage:
        """Token counts, each prompt counted once however many choices it has
        (OpenAI's rule); cached tokens are those of each prompt's first choice.
        `generated` False: what the choices generated is not part of the answer."""
        per_prompt = len(self.params)
        outputs = [h.output() for h in self.handles]
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion = sum(len(o.token_ids) for o in outputs) if generated else 0
        cached = sum(o.cached_tokens for o in outputs[::per_prompt])
        return Usage(
            prompt_tokens, completion, prompt_tokens + completion, PromptTokensDetails(cached)
        )

    def failure(self, finish_reason: str | None) -> ApiError | None:
        """The error to answer for a choice that ended in one."""
        if finish_reason is None or not finish_reason.startswith("error"):
            return None
        why = finish_reason.removeprefix("error: ")
        if why.startswith(QUEUE_TIMEOUT):
            return ApiError(503, f"not started: {why}", code="queue_timeout")
        if why.startswith(GRAMMAR_FAILED):  # the request's own constraints: its fault
            return ApiError(400, why, code="grammar_failed")
        if why == SHUTTING_DOWN:  # nothing failed: ask elsewhere, or again
            return ApiError(503, f"not finished: {why}", code="server_shutting_down")
        status = 503 if self.conductor.failure is not None else 500
        return ApiError(status, f"generation failed: {why}")

    def check(self, outputs: list[RequestOutput]) -> None:
        """Raise the error of the first choice that ended in one."""
        for out in outputs:
            error = self.failure(out.finish_reason)
            if error is not None:
                raise error

    def abort(self) -> None:
        for handle in self.handles:
            if not handle.done:
                self.conductor.abort(handle.req_id)

    async def close(self) -> None:
        left = [h.req_id for h in self.handles if not h.done]
        if left:
            log.info("http.abort", reqs=left)
            self.abort()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def _watch(self, request: web.BaseRequest) -> None:
        # aiohttp offers no awaitable for a lost connection, but drops the
        # request's transport (or leaves it closing) once it is lost.
        while not all(h.done for h in self.handles):
            transport = request.transport
            if transport is None or transport.is_closing():
                log.info("http.client_gone", path=request.path)
                self.abort()
                return
            await asyncio.sleep(WATCH_INTERVAL_S)


def rate_limited(exc: QueueFull) -> ApiError:
    """A 429 in OpenAI's shape, with the wait in `Retry-After`."""
    return ApiError(
        429,
        str(exc),
        type="requests",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(exc.retry_after_s)},
    )


async def _pump(i: int, handle: RequestHandle, queue: asyncio.Queue) -> None:
    async for delta in handle.deltas():
        queue.put_nowait((i, delta))
