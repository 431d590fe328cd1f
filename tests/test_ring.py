"""The ring with real rank processes over real gloo: greedy outputs at
pp 2, 3 and 4 equal pp 1 (and transformers), faults are survived or reported,
and no rank process outlives its LLM."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import generate_latest
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.http.prometheus import registry
from tests import model_factory
from tests.workloads import ENGINE_OPTIONS, NEW_TOKENS, hf_greedy, reference_prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# max_batch 3 forces the 8 prompts across several passes in flight
RING_OPTIONS = dict(ENGINE_OPTIONS, max_batch=3, wedge_timeout_s=20.0)

pytestmark = pytest.mark.timeout(240)


def expected_for(path):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = reference_prompts(hf.config.vocab_size)
    return prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = model_factory.llama_gqa(tmp_path_factory.mktemp("llama"))
    return (path, *expected_for(path))


def assert_no_rank_left(llm: LLM) -> None:
    procs = llm._ring.children.procs.values() if llm._ring is not None else []
    llm.close()
    assert all(p.poll() is not None for p in procs), "a rank process outlived its LLM"


@pytest.mark.parametrize("pp_size", [2, 3, 4])
def test_ring_greedy_equals_single_rank(llama, pp_size):
    path, prompts, expected = llama
    llm = LLM(path, pp_size=pp_size, **RING_OPTIONS)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected
        again = llm.generate(prompts[:2], GREEDY)
        assert [o.token_ids for o in again] == expected[:2]
        assert all(o.cached_tokens >= 40 for o in again), "the cached prompts were not reused"
    finally:
        assert_no_rank_left(llm)


@pytest.mark.parametrize(
    ("make", "pp_size", "split"),
    [
        (model_factory.qwen2_tied, 3, None),
        (model_factory.qwen3_qknorm, 2, None),
        (model_factory.bigcode_mqa, 2, [2, 1]),
    ],
)
def test_ring_greedy_equals_transformers_for_every_family(tmp_path, make, pp_size, split):
    path = make(tmp_path)
    prompts, expected = expected_for(path)
    llm = LLM(path, pp_size=pp_size, layer_split=split, **RING_OPTIONS)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        assert_no_rank_left(llm)


def test_voided_passes_are_retried_and_outputs_unchanged(llama, monkeypatch):
    path, prompts, expected = llama
    monkeypatch.setenv("RINGSERVE_FAULTS", "void:rank=1:every=5")
    llm = LLM(path, pp_size=3, **RING_OPTIONS)
    try:
        outs = llm.generate(prompts, GREEDY)
        conductor = llm._ring.conductor
        assert [o.token_ids for o in outs] == expected
        assert conductor.scheduler.voids >= 3
        text = generate_latest(registry(conductor, "m")).decode()
        assert f"ringserve_voids_total {float(conductor.scheduler.voids)}" in text.splitlines()
    finally:
        assert_no_rank_left(llm)


def test_a_request_that_breaks_its_passes_fails_alone(llama, monkeypatch):
    """Request 2's own input fails every pass it rides in on rank 1: it is
    retried alone and fails with the reason; its neighbours' outputs are
    exactly what they would have been."""
    path, prompts, expected = llama
    monkeypatch.setenv("RINGSERVE_FAULTS", "fail:rank=1:req=2")
    llm = LLM(path, pp_size=2, **RING_OPTIONS)
    try:
        outs = llm.generate(prompts, GREEDY)
        bad = outs[2]
        assert (
            bad.finish_reason.startswith("error")
            and "injected failure of request 2" in bad.finish_reason
        )
        assert [o.token_ids for i, o in enumerate(outs) if i != 2] == expected[:2] + expected[3:]
        assert all(o.finish_reason == "length" for i, o in enumerate(outs) if i != 2)
    finally:
        assert_no_rank_left(llm)


def test_a_crashed_rank_is_named_and_nothing_is_left(llama, monkeypatch):
    path, prompts, _ = llama
    monkeypatch.setenv("RINGSERVE_FAULTS", "crash:rank=2:pass=10")
    llm = LLM(path, pp_size=3, **RING_OPTIONS)
    began = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rank 2"):
            llm.generate(prompts, GREEDY)
        assert time.monotonic() - began < 15
        assert llm._ring.conductor.health.dead
        with pytest.raises(RuntimeError, match="rank 2"):  # and says why from then on
            llm.generate(prompts[:1], GREEDY)
    finally:
        assert_no_rank_left(llm)


def test_layer_split_must_cover_the_model(llama):
    path, _, _ = llama
    with pytest.raises(ValueError, match="layer_split"):
        LLM(path, pp_size=2, layer_split=[1, 1], **RING_OPTIONS)


def test_a_token_outside_the_vocabulary_is_refused_before_it_can_fail_a_pass(llama):
    path, prompts, expected = llama
    with LLM(path, **ENGINE_OPTIONS) as llm:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 10**6]], GREEDY)
        assert [o.token_ids for o in llm.generate(prompts[:2], GREEDY)] == expected[:2]
