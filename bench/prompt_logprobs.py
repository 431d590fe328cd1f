"""Prompt logprobs against the same workload without them, side by side in
one run on one model: wall time of a batch of prefill-heavy requests (long
prompts, few new tokens) with `prompt_logprobs` and without, interleaved
and repeated (median), prefix reuse off in both arms so both compute every
prompt position; and what a pass of requests that do not ask pays for the
feature on the last rank (the check that none asks), beside that pass's
forward time. Usage:
    python bench/prompt_logprobs.py [--model DIR] [--prompt-tokens 256] [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from ringserve import LLM, SamplingParams
from ringserve.engine.prompt_logprobs import prompt_logprobs
from ringserve.engine.replica import Row
from ringserve.ring.messages import Decision, Entry, SamplingSpec


def batch_s(llm: LLM, prompts: list[list[int]], top: int | None) -> float:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=top)
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    spent = time.perf_counter() - began
    assert all((o.prompt_logprobs is None) == (top is None) for o in outs)
    return spent


def idle_check_us(rows: int) -> float:
    """Microseconds the last rank spends on a pass of `rows` decode rows that do not ask."""
    spec = SamplingSpec(temperature=0.0)
    entries = [Entry(i, 10, [1], [i + 1], True) for i in range(rows)]
    decision = Decision(0, 0, [], entries, [])
    table = [Row(spec) for _ in range(rows)]
    hidden = torch.zeros(rows, 8)
    n = 20000
    spent = timeit.timeit(
        lambda: prompt_logprobs(decision, table, hidden, torch.nn.Identity()), number=n
    )
    return spent / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prompts = [
        [(7 * i + 13 * j) % 900 + 5 for j in range(args.prompt_tokens)] for i in range(args.batch)
    ]
    plain, asked = [], []
    with LLM(args.model, prefix_reuse=False) as llm:
        batch_s(llm, prompts, None)  # warm up
        for _ in range(args.repeats):
            plain.append(batch_s(llm, prompts, None))
            asked.append(batch_s(llm, prompts, 5))
    p, a = statistics.median(plain), statistics.median(asked)
    print(
        f"prefill batch {args.batch} x {args.prompt_tokens} tokens, 4 new, median of {args.repeats}"
    )
    print(f"  without prompt_logprobs  {p * 1e3:8.1f} ms")
    print(f"  prompt_logprobs=5        {a * 1e3:8.1f} ms   ratio {a / p:.2f}")
    for rows in (1, 32):
        print(f"last rank, a pass of {rows:2d} rows that do not ask: {idle_check_us(rows):.2f} us")


if __name__ == "__main__":
    main()
