"""CPU passes that mix decoding and prefilling sequences, with ringserve's
CPU kernels (`--cpu-kernels native`) against torch's ops alone, in
interleaved rounds of one run.

Workload: `--requests` prompts of random lengths up to `--max-prompt`, all
submitted at once, each decoding `--new-tokens` greedy tokens, with a pass
budget that makes the scheduler chunk the long prompts beside the running
decodes: most passes mix one-token rows with prefill chunks. Attention over
one padded batch would pad every decoding row to the chunk's queries; the
native path attends each kind apart. Usage:
    .venv/bin/python bench/mixed_passes.py [--model DIR] [--requests 32]
        [--max-prompt 768] [--new-tokens 32] [--rounds 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from ringserve import LLM, SamplingParams


def prompts(n: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, longest))] for _ in range(n)]


def run(llm: LLM, batch: list[list[int]], new: int) -> tuple[float, float]:
    """(generated tokens per second, all tokens per second) of one call."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    spent = time.perf_counter() - began
    assert all(len(o.token_ids) == new for o in outs)
    return len(batch) * new / spent, sum(len(p) + new for p in batch) / spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: built-in model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    options = dict(
        dtype=args.dtype, torch_threads=1, max_batch=args.requests, chunk_size=128,
        max_tokens_per_pass=256, max_model_len=args.max_prompt + args.new_tokens,
    )  # fmt: skip
    engines = {c: LLM(args.model, cpu_kernels=c, **options) for c in ("native", "torch")}
    try:
        vocab = engines["native"]._ring.conductor.vocab_size
        outputs = {}
        for choice, llm in engines.items():  # warm-up, and the same tokens either way
            warm = prompts(args.requests, args.max_prompt, vocab, -1)
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            outputs[choice] = [o.token_ids for o in llm.generate(warm, params, use_tqdm=False)]
        rates: dict[str, list[tuple[float, float]]] = {c: [] for c in engines}
        for r in range(args.rounds):
            batch = prompts(args.requests, args.max_prompt, vocab, r)
            for choice, llm in engines.items():
                rates[choice].append(run(llm, batch, args.new_tokens))
    finally:
        for llm in engines.values():
            llm.close()
    same = outputs["native"] == outputs["torch"]
    print(
        f"{args.requests} requests, prompts 8-{args.max_prompt} tokens, {args.new_tokens} new "
        f"tokens, 256-token passes, 128-token chunks, one thread, {args.dtype}; "
        f"median of {args.rounds} interleaved rounds"
    )
    for choice, got in rates.items():
        gen = statistics.median(g for g, _ in got)
        tot = statistics.median(t for _, t in got)
        print(f"  {choice:<7} {gen:8.1f} generated tok/s  {tot:9.1f} prompt + generated tok/s")
    ratio = statistics.median(
        n[1] / t[1] for n, t in zip(rates["native"], rates["torch"], strict=True)
    )
    print(f"  native / torch: {ratio:.2f}x; same greedy tokens: {same}")


if __name__ == "__main__":
    main()
