"""The decode-heavy workload the ring benchmarks share: random 16-token
prompts and greedy decoding of a fixed number of tokens per prompt. Bench
scripts import it as a sibling module (`python bench/x.py` puts bench/ on
the path)."""

from __future__ import annotations

import random
import time

from ringserve import LLM, SamplingParams


def workload(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n)]


def tokens_per_s(llm: LLM, prompts: list[list[int]], new: int) -> float:
    """Generated tokens per second of wall time for one `generate` call."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == new for o in outs)
    return len(prompts) * new / (time.perf_counter() - began)
