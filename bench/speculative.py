"""Speculative decoding against none, side by side in one run: decode tok/s
and acceptance at batch 1, 4 and 16, on a workload whose answers repeat
their prompts and on one whose answers do not.

Model: `tests/model_factory.copy_100m`, a generated Llama of `llama_100m`'s
size (about 111M parameters, memory bound at small batch) whose greedy
continuation of a token is mostly a fixed successor of it. Random weights
never repeat a prompt on their own; this model does what a summariser or an
editor does with its source text: given a text it wrote, it writes it again.

* repeating: each prompt is a text of --text-len tokens that the model
  wrote (greedy, from a random 4-token start), a random token, and the
  text's first two tokens: the answer goes on copying the text;
* edited: the same prompts with one token in 8 of the text replaced by a
  random one: the answer (the text as the model writes it) departs from the
  prompt at each changed token, so some proposals fail;
* fresh: random prompts of the same length; the answer is new text.

For each workload and batch, one engine with `--speculative ngram` and one
without decode the same prompts; each run first takes one token (prefill,
left in the prefix cache), then the timed run generates --new-tokens more
from the cached prompts, so the figure is decode. Outputs of the two
engines are compared token for token (greedy). Acceptance = accepted /
proposed speculative tokens; "per step" = tokens a verification yields.

Usage:
    PYTHONPATH=. .venv/bin/python bench/speculative.py [--batches 1 4 16]
        [--new-tokens 64] [--text-len 96] [--repeats 2] [--k 4]
        [--method ngram|draft] [--workloads repeating edited fresh]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringserve import LLM, SamplingParams  # noqa: E402
from tests.model_factory import copy_100m, copy_draft  # noqa: E402

VOCAB = 8192
EDIT_EVERY = 8


def model_dir(root: Path) -> Path:
    path = root / "copy_100m"
    if not (path / "config.json").is_file():
        copy_100m(root)
    return path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def workloads(llm: LLM, n: int, text_len: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    starts = [[rng.randrange(3, VOCAB) for _ in range(4)] for _ in range(n)]
    texts = [o.token_ids for o in llm.generate(starts, greedy(text_len), use_tqdm=False)]
    repeating = [t + [rng.randrange(3, VOCAB)] + t[:2] for t in texts]
    edited = [[*p] for p in repeating]
    for p in edited:  # one token in 8 of the given text changed: the answer departs there
        for i in range(EDIT_EVERY - 1, len(p) - 3, EDIT_EVERY):
            p[i] = rng.randrange(3, VOCAB)
    fresh = [[rng.randrange(3, VOCAB) for _ in range(len(p))] for p in repeating]
    return {"repeating": repeating, "edited": edited, "fresh": fresh}


def decode(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, float, list[list[int]]]:
    """(decode tok/s of wall time, of this process's CPU time, outputs):
    prefill and one token first, untimed. With one rank the whole engine
    runs in this process, so CPU time is what the decode cost, steadier than
    wall time on a machine shared with other work."""
    llm.generate(prompts, greedy(1), use_tqdm=False)
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, greedy(1 + new), use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = len(prompts) * new
    return tokens / wall, tokens / cpu, [o.token_ids for o in outs]


def spec_stats(llm: LLM) -> tuple[int, int, int]:
    s = llm._ring.conductor.scheduler.speculation.stats
    return s.verifications, s.proposed, s.accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/ringserve-bench"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--text-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--method",
        choices=["ngram", "draft"],
        default="ngram",
        help="draft: tests/model_factory.copy_draft (2 layers, hidden 256) proposes",
    )
    ap.add_argument("--workloads", nargs="+", default=["repeating", "edited", "fresh"])
    args = ap.parse_args()
    path = model_dir(args.model_dir)
    common = dict(kv_capacity_tokens=16384, torch_threads=args.threads, max_batch=64)
    spec = dict(speculative="ngram", num_speculative_tokens=args.k, ngram_max=4, ngram_min=2)
    if args.method == "draft":
        draft = args.model_dir / "copy_draft"
        if not (draft / "config.json").is_file():
            copy_draft(args.model_dir)
        spec.update(speculative="draft", draft_model=draft)
    print(
        f"model {path.name}, {args.method} k {args.k}, {args.new_tokens} new tokens, "
        f"{args.threads} thread(s)"
    )
    print(f"{'workload':10} {'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} "
          f"{'cpu ratio':>9} {'accept':>7} {'per step':>8} {'same':>5}")  # fmt: skip
    with LLM(path, **common) as off, LLM(path, **common, **spec) as on:
        loads = workloads(off, max(args.batches), args.text_len, seed=1)
        for name in args.workloads:
            prompts = loads[name]
            for b in args.batches:
                row(name, b, prompts, off, on, args)


def row(name: str, b: int, prompts: list[list[int]], off: LLM, on: LLM, args) -> None:
    rates_off, rates_on, same = [], [], True
    cpu_off, cpu_on = [], []
    before = spec_stats(on)
    for r in range(args.repeats):
        # a fresh batch each repeat (the previous is cached whole), same texts shifted
        batch = [p[r:] for p in prompts[:b]]
        pair = [(off, rates_off, cpu_off), (on, rates_on, cpu_on)]
        for engine, rates, cpus in pair if r % 2 == 0 else pair[::-1]:
            rate, cpu_rate, outs = decode(engine, batch, args.new_tokens)
            rates.append(rate)
            cpus.append(cpu_rate)
            if engine is off:
                want = outs
            else:
                got = outs
        same &= got == want
    after = spec_stats(on)
    steps, proposed, accepted = (a - b_ for a, b_ in zip(after, before, strict=True))
    t_off, t_on = statistics.median(rates_off), statistics.median(rates_on)
    accept = accepted / proposed if proposed else 0.0
    per_step = (accepted + steps) / steps if steps else 1.0
    print(
        f"{name:10} {b:5d} {t_off:10.1f} {t_on:10.1f} {t_on / t_off:6.2f} "
        f"{statistics.median(cpu_on) / statistics.median(cpu_off):9.2f} "
        f"{accept:7.1%} {per_step:8.2f} {str(same):>5}",
        flush=True,
    )


if __name__ == "__main__":
    main()
