"""Logits processing (penalties, bias, bans) equals a reference written here,
on the model's own logits from transformers, token for token: on one rank
and on a ring of three with voids, over chunked prompts and prefix reuse."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.engine.logits import process_row
from ringserve.engine.processing_params import bad_word_ids
from ringserve.models.tokenizer import Tokenizer
from ringserve.ring.messages import SamplingSpec
from ringserve.sched.request import sampling_spec
from tests import model_factory
from tests.workloads import ENGINE_OPTIONS, reference_prompts

NEW_TOKENS = 12
pytestmark = pytest.mark.timeout(240)


def reference_logits(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    """vLLM's order, spelt out one token at a time."""
    x = logits.clone().double()
    for t, b in (p.logit_bias or {}).items():
        x[t] += max(-100.0, min(100.0, b))
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in collections.Counter(output).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    if len(output) < p.min_tokens:
        for t in p.stop_token_ids:
            x[t] = float("-inf")
    if p.allowed_token_ids is not None:
        for t in range(len(x)):
            if t not in p.allowed_token_ids:
                x[t] = float("-inf")
    for word in p.bad_words_token_ids:
        if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1 :] == list(
            word[:-1]
        ):
            x[word[-1]] = float("-inf")
    return x


def reference_greedy(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    output: list[int] = []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = hf(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_logits(logits, prompt, output, p).argmax()))
    return output


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = model_factory.llama_gqa(tmp_path_factory.mktemp("llama"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompts = reference_prompts(vocab)
    words = bad_word_ids(("the", "ing"), Tokenizer.from_dir(path))
    base = dict(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    kinds = [
        SamplingParams(**base, repetition_penalty=1.2, frequency_penalty=2.0),
        SamplingParams(**base, presence_penalty=1.5, logit_bias={5: 4.0, 17: -100.0, 99: 300.0}),
        SamplingParams(**base, repetition_penalty=0.7, presence_penalty=-0.5),
        SamplingParams(**base, allowed_token_ids=tuple(range(10, 200, 3)), frequency_penalty=2.0),
        SamplingParams(**base, bad_words_token_ids=words, frequency_penalty=1.0),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    plain = SamplingParams(**base)
    # min_tokens: the stop id is the token plain greedy would stop on first
    first = reference_greedy(hf, prompts[0], plain)[0]
    params[5] = SamplingParams(**base, min_tokens=4, stop_token_ids=(first,), frequency_penalty=2.0)
    expected = [reference_greedy(hf, pr, pa) for pr, pa in zip(prompts, params, strict=True)]
    unshaped = [reference_greedy(hf, pr, plain) for pr in prompts]
    assert sum(e != u for e, u in zip(expected, unshaped, strict=True)) >= 5, "too weak to tell"
    return path, prompts, params, expected


def test_processing_equals_the_reference_on_one_rank(workload):
    path, prompts, params, expected = workload
    with LLM(path, **ENGINE_OPTIONS) as llm:
        outs = llm.generate(prompts, params)
        again = llm.generate(prompts, params)  # now from the prefix cache
    assert [o.token_ids for o in outs] == expected
    assert [o.token_ids for o in again] == expected
    assert all(o.cached_tokens >= len(o.prompt_token_ids) - 1 for o in again)


def test_processing_equals_the_reference_on_a_ring_with_voids(workload, monkeypatch):
    monkeypatch.setenv("RINGSERVE_FAULTS", "void:rank=2:every=4")
    path, prompts, params, expected = workload
    with LLM(path, pp_size=3, max_batch=3, wedge_timeout_s=20.0, **ENGINE_OPTIONS) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected


def test_a_row_is_processed_by_its_spec_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 64) * 4
    params = SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={3: 2.0}
    )
    spec = sampling_spec(params, prompt_len=4)
    history = [1, 2, 3, 4, 9, 9, 10]
    got = process_row(logits[1], spec, history, len(history))
    want = reference_logits(logits[1], history[:4], history[4:], params)
    torch.testing.assert_close(got.double(), want)
    assert torch.equal(process_row(logits[0], SamplingSpec(), None, 0), logits[0])


def test_the_replica_keeps_a_rows_tokens_through_a_rolled_back_pass():
    from ringserve.engine.replica import Replica
    from ringserve.ring.messages import Decision, Entry, NewRequest

    spec = sampling_spec(SamplingParams(frequency_penalty=1.0), prompt_len=4)
    replica = Replica()
    admit = Entry(0, 2, [3, 4], [7, 8], True, reuse=[5, 6])
    replica.apply(Decision(0, 0, [NewRequest(0, spec, [1, 2])], [admit], []))
    replica.apply(Decision(1, 0, [], [Entry(0, 4, [40], [9], True)], []))  # voided
    (row,) = replica.apply(Decision(2, 0, [], [Entry(0, 4, [41], [10], True)], []))
    assert row.tokens == [1, 2, 3, 4, 41] and row.slots.tolist() == [5, 6, 7, 8, 10]
