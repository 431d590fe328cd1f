"""Model configurations beyond the families' common shapes: a GPT-BigCode
with a head of its own or without multi-query, and sliding-window attention, which ringserve
serves by keeping every context within the window (where full attention
and the window agree) and never by running past it silently."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.models.config import ModelConfig
from ringserve.models.rope import rope_parameters
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


TINY = {"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 8, "max_position_embeddings": 256}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE_CONFIGS = {
    # the rope dict's theta before the top-level one
    "theta_in_both": {
        "rope_theta": 1e4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    },
    # the legacy rope_scaling before rope_parameters, the top-level theta for it
    "scaling_and_parameters": {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        "rope_theta": 900.0,
    },
    # the top-level pretrained context before the dict's (as for Phi-3)
    "llama3_top_level_context": {
        "rope_parameters": {**LLAMA3, "original_max_position_embeddings": 64, "rope_theta": 5e5},
        "original_max_position_embeddings": 16,
    },
    "llama3_no_context": {"rope_scaling": LLAMA3, "rope_theta": 5e5},
    "yarn_top_level_context": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "original_max_position_embeddings": 32,
    },
}


@pytest.mark.parametrize("case", list(ROPE_CONFIGS))
def test_rope_settings_given_twice_are_read_as_transformers_reads_them(tmp_path, case):
    """Frequencies and scale against a transformers model built from the
    same config.json, where a config says a rope setting in two places."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **ROPE_CONFIGS[case]}))
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    inv_freq, scale = rope_parameters(ModelConfig.from_dir(tmp_path))
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq)
    assert scale == pytest.approx(hf.model.rotary_emb.attention_scaling)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**TINY, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            {
                "model_type": "gpt_bigcode",
                "vocab_size": 8,
                "n_embd": 8,
                "n_layer": 1,
                "n_head": 2,
                "activation_function": "relu",
            },
            "activation_function 'relu' is not supported by gpt_bigcode",
        ),  # fmt: skip
    ],
)
def test_an_activation_not_served_is_refused_with_the_config(config, message):
    """Refused where the config is read (the launcher's one line, exit 2),
    not once a rank builds its layers."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(config)


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
