"""Model configurations beyond the families' common shapes: a GPT-BigCode
with a head of its own or without multi-query, and sliding-window attention, which ringserve
serves by keeping every context within the window (where full attention
and the window agree) and never by running past it silently."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.models.config import ModelConfig
from tests import model_factory
from tests.test_ring import RING_OPTIONS, assert_no_rank_left, expected_for
from tests.workloads import ENGINE_OPTIONS, NEW_TOKENS, greedy_case, hf_greedy

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

pytestmark = pytest.mark.timeout(240)


BIGCODES = [model_factory.bigcode_untied, model_factory.bigcode_mha]


@pytest.mark.parametrize("make", BIGCODES)
def test_bigcode_variants_equal_transformers(tmp_path, make):
    """An untied head is its own matrix; without multi-query, every head
    has its K and V."""
    path, prompts, expected = greedy_case(make(tmp_path))
    with LLM(path, **ENGINE_OPTIONS) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("make", BIGCODES)
def test_bigcode_variants_on_a_ring(tmp_path, make):
    path = make(tmp_path)
    prompts, expected = expected_for(path)
    llm = LLM(path, pp_size=2, **RING_OPTIONS)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        assert_no_rank_left(llm)


def test_a_sliding_window_bounds_the_context(tmp_path):
    """Within the window ringserve equals transformers (which applies it);
    past it, a prompt is refused and a generation ends, instead of running
    attention the model was not trained with."""
    window = 32
    path = model_factory.mistral_window(tmp_path, window)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (3, 17, window - NEW_TOKENS)]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    with LLM(path, **ENGINE_OPTIONS) as llm:
        assert llm._ring.conductor.scheduler.config.max_model_len == window
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        (cut,) = llm.generate([prompts[-1] + [5, 6]], GREEDY)
        assert len(cut.token_ids) == NEW_TOKENS - 2 and cut.finish_reason == "length"
        with pytest.raises(ValueError, match="context"):
            llm.generate([[7] * window], GREEDY)


ROPES = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 48,
        "mscale": 0.9,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "truncate": False,
    },
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_scalings_equal_transformers(tmp_path, rope):
    """Prompts past the pretrained context of the scaled kinds too."""
    path, prompts, expected = greedy_case(model_factory.qwen2_rope(tmp_path, ROPES[rope]))
    with LLM(path, **ENGINE_OPTIONS) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_a_rope_scaling_not_served_is_refused_by_name():
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        ModelConfig.from_dict({**MISTRAL, "rope_scaling": {"rope_type": "dynamic", "factor": 2}})


MISTRAL = {"model_type": "mistral", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 4,
           "num_attention_heads": 2, "intermediate_size": 8, "max_position_embeddings": 32768}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "window"),
    [
        ({"sliding_window": 4096}, 4096),
        ({"sliding_window": None}, None),
        ({"model_type": "llama", "sliding_window": 4096}, None),
        ({"model_type": "qwen2", "sliding_window": 4096}, None),  # use_sliding_window off
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, None),
        (
            {
                "model_type": "qwen3",
                "sliding_window": 64,
                "use_sliding_window": True,
                "max_window_layers": 2,
            },
            64,
        ),  # fmt: skip
        (
            {
                "model_type": "qwen2",
                "sliding_window": 64,
                "use_sliding_window": True,
                "layer_types": ["full_attention"] * 3 + ["sliding_attention"],
            },
            64,
        ),  # fmt: skip
    ],
)
def test_the_window_is_read_as_transformers_reads_it(extra, window):
    cfg = ModelConfig.from_dict({**MISTRAL, **extra})
    assert cfg.sliding_window == window
    assert cfg.context_limit == min(32768, window or 32768)
