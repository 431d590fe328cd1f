"""Greedy generation through the whole engine equals transformers token for
token, for every model family, over a batch that shares a long prefix and has
a chunked prompt, with prefix reuse on."""

from __future__ import annotations

import pytest

from ringserve import LLM, SamplingParams
from tests import model_factory
from tests.workloads import ENGINE_OPTIONS, NEW_TOKENS, greedy_case

FAMILIES = model_factory.FAMILIES
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return greedy_case(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


def test_greedy_equals_transformers_with_prefix_reuse_and_chunking(family):
    path, prompts, expected = family
    with LLM(path, **ENGINE_OPTIONS) as llm:
        first = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert all(o.finish_reason == "length" for o in first + again)
    assert any(o.cached_tokens >= 32 for o in first), "the shared prefix was never reused"
    assert all(o.cached_tokens >= len(o.prompt_token_ids) - 1 for o in again)


def test_greedy_equals_transformers_without_prefix_reuse(family):
    path, prompts, expected = family
    with LLM(path, prefix_reuse=False, **ENGINE_OPTIONS) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.cached_tokens == 0 for o in outs)
