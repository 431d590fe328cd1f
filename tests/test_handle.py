"""A request's handle: a reader of `deltas` gets every token in order, one
Delta a pass; `result` waits for the end alone, woken once however many
passes the request takes."""

from __future__ import annotations

import asyncio

from ringserve.engine.handle import RequestHandle
from ringserve.engine.textstream import TextStream
from ringserve.models.builtin import builtin_model_dir
from ringserve.models.tokenizer import Tokenizer
from ringserve.params import SamplingParams
from ringserve.sched.request import Phase, RequestFactory


def handle_of(max_tokens: int) -> RequestHandle:
    tok = Tokenizer.from_dir(builtin_model_dir())
    req = RequestFactory(frozenset())([1, 2], SamplingParams(max_tokens=max_tokens))
    return RequestHandle(req, TextStream(tok, ()))


async def deliver(handle: RequestHandle, tokens: list[int]) -> None:
    """One token a pass, as the desk hands them over, then the end."""
    for i, t in enumerate(tokens):
        await asyncio.sleep(0)
        handle.req.output.append(t)
        if i == len(tokens) - 1:
            handle.req.phase, handle.req.finish_reason = Phase.FINISHED, "length"
        handle.take_new_tokens()


async def test_deltas_bring_every_token_in_order_and_end_with_the_reason():
    handle, tokens = handle_of(6), [5, 6, 7, 8, 9, 10]
    feeder = asyncio.create_task(deliver(handle, tokens))
    got = [d async for d in handle.deltas()]
    await feeder
    assert [t for d in got for t in d.token_ids] == tokens
    assert [d.finish_reason for d in got] == [None] * 5 + ["length"]


async def test_result_is_woken_once_and_queues_no_delta():
    """Driven by hand: each future `result` yields is one suspension, and
    resuming it once that future is done is one wake-up."""
    handle, tokens = handle_of(41), list(range(5, 45))
    handle.req.output.append(4)  # a token delivered before anyone waits
    handle.take_new_tokens()
    coro = handle.result()
    waits, out = [coro.send(None)], None
    for i, t in enumerate(tokens):
        handle.req.output.append(t)
        if i == len(tokens) - 1:
            handle.req.phase, handle.req.finish_reason = Phase.FINISHED, "length"
        handle.take_new_tokens()
        if waits[-1].done():
            try:
                waits.append(coro.send(None))
            except StopIteration as end:
                out = end.value
    assert out is not None and out.token_ids == [4, *tokens] and out.finish_reason == "length"
    assert len(waits) == 1, f"result was woken {len(waits)} times for {len(tokens)} passes"
    assert handle.queue.empty()


async def test_result_of_a_request_that_has_ended_returns_at_once():
    handle = handle_of(1)
    await deliver(handle, [9])
    out = await asyncio.wait_for(handle.result(), 1.0)
    assert out.token_ids == [9] and out.finish_reason == "length"


def test_stop_reason_is_none_for_the_tokenizers_eos_and_the_id_for_other_stop_ids():
    """As vLLM: the tokenizer's EOS ends with stop_reason None; the model's
    other EOS ids (a generation config's) and stop_token_ids give the id;
    without a tokenizer every EOS id is an EOS."""

    def reason(last: int, tokenizer_eos: int | None, **params) -> int | str | None:
        req = RequestFactory(frozenset({1, 5}))([9, 9], SamplingParams(max_tokens=8, **params))
        req.output, req.phase, req.finish_reason = [7, last], Phase.FINISHED, "stop"
        return RequestHandle(req, TextStream(None), tokenizer_eos).stop_reason

    assert reason(1, tokenizer_eos=1) is None
    assert reason(5, tokenizer_eos=1) == 5
    assert reason(5, tokenizer_eos=None) is None
    assert reason(8, tokenizer_eos=1, stop_token_ids=[8]) == 8
    assert reason(1, tokenizer_eos=1, stop_token_ids=[1], ignore_eos=True) == 1
    assert reason(1, tokenizer_eos=1, stop_token_ids=[1]) is None  # EOS first, as vLLM checks
