"""A request's context never outgrows the KV pool: the context length is
capped at the pool's usable slots, so a long answer ends with `length`
instead of waiting for slots that can never come."""

from __future__ import annotations

import pytest

from ringserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(120)


def test_an_answer_longer_than_the_pool_ends_with_length():
    engine = dict(kv_capacity_tokens=48, max_tokens_per_pass=16, chunk_size=16, max_batch=4)
    with LLM(max_model_len=4096, wedge_timeout_s=20, **engine) as llm:
        sched = llm._ring.conductor.scheduler
        usable = sched.allocator.capacity - 1
        assert sched.config.max_model_len == usable < 200
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        (out,) = llm.generate([list(range(3, 13))], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert 10 + len(out.outputs[0].token_ids) == usable
