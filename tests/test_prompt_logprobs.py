"""Prompt logprobs equal transformers' log_softmax over its logits, position
by position, with chunked prefill, on one rank and on a ring of three whose
passes are voided now and then; a request asking for them reuses no cached
prefix."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.replay import replay
from tests import model_factory
from tests.workloads import ENGINE_OPTIONS, reference_prompts

TOP = 3
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=TOP)


def hf_prompt_logprobs(hf: torch.nn.Module, prompt: list[int]) -> list[dict[int, float] | None]:
    """vLLM's shape from transformers: None, then per token its own logprob
    and the top ones at its position."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    out: list[dict[int, float] | None] = [None]
    for t in range(1, len(prompt)):
        vals, ids = lp[t - 1].topk(TOP)
        entry = dict(zip(ids.tolist(), vals.tolist(), strict=True))
        entry[prompt[t]] = float(lp[t - 1, prompt[t]])
        out.append(entry)
    return out


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = model_factory.llama_gqa(tmp_path_factory.mktemp("plogp"))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = reference_prompts(hf.config.vocab_size)[3:7]  # one of 70 tokens: 5 chunks
    return path, prompts, [hf_prompt_logprobs(hf, p) for p in prompts]


def assert_matches(got: list[dict[int, float] | None] | None, want: list) -> None:
    assert got is not None and len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert sorted(g) == sorted(w)
        for token, lp in w.items():
            assert g[token] == pytest.approx(lp, abs=1e-4)


def test_prompt_logprobs_equal_transformers_with_chunks_and_no_prefix_reuse(workload):
    path, prompts, want = workload
    with LLM(path, **ENGINE_OPTIONS) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # fills the cache
        outs = llm.generate(prompts, PARAMS)
        plain = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    for out, w in zip(outs, want, strict=True):
        assert_matches(out.prompt_logprobs, w)
        assert out.cached_tokens == 0
    assert all(o.prompt_logprobs is None for o in plain)
    assert any(o.cached_tokens > 0 for o in plain), "the cache was never warm"
    with LLM(path, kv_capacity_tokens=2048) as llm:  # whole prompts: several slices a pass
        whole = llm.generate(prompts, PARAMS)
    for out, w in zip(whole, want, strict=True):
        assert_matches(out.prompt_logprobs, w)


def test_prompt_logprobs_equal_transformers_on_a_ring_with_voids(workload, monkeypatch, tmp_path):
    """Beside plain requests that share their prefixes; the run replays."""
    monkeypatch.setenv("RINGSERVE_FAULTS", "void:rank=2:every=3")
    path, prompts, want = workload
    plain = SamplingParams(max_tokens=2, temperature=0)
    options = dict(pp_size=3, max_batch=2, wedge_timeout_s=20.0, log_dir=str(tmp_path))
    with LLM(path, **options, **ENGINE_OPTIONS) as llm:
        outs = llm.generate(prompts + prompts, [PARAMS] * len(prompts) + [plain] * len(prompts))
    for out, w in zip(outs[: len(prompts)], want, strict=True):
        assert_matches(out.prompt_logprobs, w)
        assert out.cached_tokens == 0
    report = replay(tmp_path)
    assert report.rerun.reproduced and not report.kinds()
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    voids = [e for e in map(json.loads, lines) if e["event"] == "pass.void"]
    assert voids, "no pass was voided"
