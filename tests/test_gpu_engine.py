"""The engine on a GPU (`device="cuda"`): greedy generation equals
transformers token for token for each family, on one rank and on a ring of
two ranks sharing the GPU, whose hidden states leave the GPU for gloo and
come back; sampled requests draw the same tokens as on the CPU. Skipped
where torch sees no GPU; `bench/gpu_check.py` runs this file on one."""

from __future__ import annotations

import pytest
import torch

from ringserve import LLM, SamplingParams
from tests import model_factory
from tests.workloads import ENGINE_OPTIONS, NEW_TOKENS, greedy_case, reference_prompts

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]

FAMILIES = {k: model_factory.FAMILIES[k] for k in ("llama_gqa", "qwen3_qknorm", "bigcode_mqa")}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return greedy_case(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_greedy_on_the_gpu_equals_transformers(family, pp_size, eager):
    path, prompts, expected = family
    with LLM(path, pp_size=pp_size, device="cuda", enforce_eager=eager, **ENGINE_OPTIONS) as llm:
        assert llm.config.device == "cuda"
        # rank 0 runs in this process: its weights and KV pool are on the GPU
        runner = llm._ring.conductor.stage.runner
        assert runner.pool.k[0].is_cuda and next(runner.model.parameters()).is_cuda
        first = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts, GREEDY)  # the prefixes now come from the cache
        graphs = runner.graphs
        # decode passes replayed rank 0's graphs, unless told to run eagerly
        assert (graphs is None) if eager else graphs.replays > 0
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert all(o.cached_tokens >= len(o.prompt_token_ids) - 1 for o in again)


def test_a_seeded_request_on_the_gpu_draws_the_same_tokens_every_time(tmp_path):
    """The noise of a seeded draw comes from the GPU's generator seeded by
    (seed, position), so the same requests draw the same tokens again, on
    one rank and on a ring, and another seed draws others."""
    path = model_factory.llama_gqa(tmp_path)
    prompts = reference_prompts(512)[:4]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)

    runs = []
    for pp_size in (1, 2):
        with LLM(path, pp_size=pp_size, device="cuda", **ENGINE_OPTIONS) as llm:
            runs += [[o.token_ids for o in llm.generate(prompts, params(7))] for _ in range(2)]
            other = [o.token_ids for o in llm.generate(prompts, params(8))]
    assert all(run == runs[0] for run in runs)
    assert other != runs[0]
