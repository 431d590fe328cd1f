"""A decode pass's sampling on the CPU: the whole-row sort of
`sample_reference` against `sample_candidates` (the head of each row's
order), side by side in one run, at vocabularies of the built-in model,
Llama 2 and Llama 3, for the settings users send most; and the `Sampler`
call a pass makes (noise and logits processing included). Logits are
peaked as a model's are (normal, scale 8). Usage:
    .venv/bin/python bench/sampling.py [--rows 32] [--vocabs 2048,32000,128256]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from ringserve.engine.sampler import Sampler
from ringserve.kernels.sample_cpu import sample_candidates
from ringserve.kernels.sample_reference import sample_reference
from ringserve.ring.messages import SamplingSpec

SETTINGS = {  # name: (temperature, top_k, top_p, min_p)
    "temperature 0.8": (0.8, 0, 1.0, 0.0),
    "top-p 0.95": (0.8, 0, 0.95, 0.0),
    "top-k 40, top-p 0.9": (0.7, 40, 0.9, 0.0),
    "min-p 0.05": (1.0, 0, 1.0, 0.05),
}


def ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocabs", default="2048,32000,128256")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.rows
    print(f"{n} sampled rows, one thread, median of {args.repeats}")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        gen = torch.Generator().manual_seed(vocab)
        logits = torch.randn(n, vocab, generator=gen) * 8
        noise = torch.rand(n, vocab, generator=gen)
        for name, (t, k, p, m) in SETTINGS.items():
            params = (
                torch.full((n,), t),
                torch.full((n,), k, dtype=torch.int64),
                torch.full((n,), p),
                torch.full((n,), m),
            )
            case = (logits, *params, noise)
            ref = ms(functools.partial(sample_reference, *case), args.repeats)
            fast = ms(functools.partial(sample_candidates, *case), args.repeats)
            specs = [
                SamplingSpec(temperature=t, top_k=k, top_p=p, min_p=m, seed=i) for i in range(n)
            ]
            call = functools.partial(Sampler(), 0, logits, specs, list(range(n)))
            whole = ms(call, args.repeats)
            print(
                f"  vocab {vocab:6d}, {name:20s}: sort {ref:7.1f} ms, head {fast:6.1f} ms "
                f"({ref / fast:4.1f}x); the Sampler's call {whole:6.1f} ms"
            )


if __name__ == "__main__":
    main()
