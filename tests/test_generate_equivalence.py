"""Greedy generation through the whole engine equals transformers token for
token, for every model family, over a batch that shares a long prefix and has
a chunked prompt, with prefix reuse on."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from tests import model_factory
from tests.workloads import ENGINE_OPTIONS, NEW_TOKENS, hf_greedy, reference_prompts

FAMILIES = {
    "llama_gqa": model_factory.llama_gqa,
    "llama3_rope_scaling": lambda tmp: model_factory.llama_gqa(tmp, rope_scaling=True),
    "qwen2_tied": model_factory.qwen2_tied,
    "qwen3_qknorm": model_factory.qwen3_qknorm,
    "bigcode_mqa": model_factory.bigcode_mqa,
}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = reference_prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return path, prompts, expected


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
