"""Offline throughput, measured side by side in one run on one model:

* ringserve's `LLM.generate` (scheduler, caches, sampler, text),
* transformers' batched greedy `generate` on the same checkpoint,
* ringserve's own model forward in a bare loop at the same batch shape
  (one prefill of every prompt, then one decode step per token): the
  engine's limit on this machine.

Workload: 48 requests sharing a 96-token system prompt, each with its own
short suffix, 64 new tokens each, greedy. Usage:
    .venv/bin/python bench/offline.py [--requests 48] [--new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from ringserve import LLM, SamplingParams
from ringserve.cache.pool import KVPool
from ringserve.kernels.batch import ForwardBatch
from ringserve.models.builtin import builtin_model_dir
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(96)]
    return [
        system + [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 17))] for _ in range(n)
    ]


def run_ringserve(llm: LLM, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - began
    assert all(len(o.token_ids) == new for o in outs)
    return len(prompts) * new / elapsed


def run_transformers(model, prompts: list[list[int]], new: int, pad: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    began = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=pad,
        )  # fmt: skip
    elapsed = time.perf_counter() - began
    assert out.shape[1] - width == new
    return len(prompts) * new / elapsed


@torch.inference_mode()
def run_bare(model, cfg: ModelConfig, prompts: list[list[int]], new: int) -> float:
    """Prefill every prompt in one forward, then `new` decode forwards of the
    whole batch: the same tensors the engine builds, with no scheduling."""
    total = sum(len(p) for p in prompts) + len(prompts) * new + 1
    pool = KVPool(cfg.num_layers, total, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    began = time.perf_counter()
    next_slot, rows = 1, []
    for p in prompts:
        rows.append(list(range(next_slot, next_slot + len(p))))
        next_slot += len(p)
    batch = ForwardBatch.build(rows, [len(p) for p in prompts], [True] * len(prompts))
    ids = torch.tensor([t for p in prompts for t in p])
    tokens = model.logits(model(ids, batch, pool)[batch.sample_rows]).argmax(-1)
    for _ in range(new - 1):
        for row in rows:
            row.append(next_slot)
            next_slot += 1
        batch = ForwardBatch.build(rows, [1] * len(rows), [True] * len(rows))
        tokens = model.logits(model(tokens, batch, pool)[batch.sample_rows]).argmax(-1)
    return len(prompts) * new / (time.perf_counter() - began)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = builtin_model_dir()
    cfg = ModelConfig.from_dir(path)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    bare = load_model(path, cfg, range(cfg.num_layers), dtype)
    llm = LLM(
        path, dtype=args.dtype, max_batch=args.requests, max_tokens_per_pass=2048, chunk_size=512
    )
    figures: dict[str, list[float]] = {"ringserve": [], "transformers": [], "bare forward": []}
    # warm every engine up at the full shape (allocator pages, caches) on
    # a different workload than any measured round
    warm = workload(args.requests, cfg.vocab_size, seed=-1)
    run_ringserve(llm, warm, args.new_tokens)
    run_transformers(hf, warm, 8, pad=0)
    run_bare(bare, cfg, warm, 8)
    for rep in range(args.repeats):  # alternate so machine noise hits all three alike
        # a fresh system prompt each round: no run reuses another's cache
        prompts = workload(args.requests, cfg.vocab_size, seed=rep)
        figures["ringserve"].append(run_ringserve(llm, prompts, args.new_tokens))
        figures["transformers"].append(run_transformers(hf, prompts, args.new_tokens, pad=0))
        figures["bare forward"].append(run_bare(bare, cfg, prompts, args.new_tokens))
    best = {k: max(v) for k, v in figures.items()}
    print(f"{args.requests} requests, 96-token shared prefix, {args.new_tokens} new tokens, "
          f"{args.dtype}, torch threads {torch.get_num_threads()}")  # fmt: skip
    for name, tps in best.items():
        print(
            f"  {name:14s} {tps:9.1f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in figures[name])})"
        )
    print(
        f"  ringserve / transformers = {best['ringserve'] / best['transformers']:.2f}x (goal >= 3)"
    )
    print(
        f"  ringserve / bare forward = {best['ringserve'] / best['bare forward']:.2f} (goal >= 0.8)"
    )
    llm.close()


if __name__ == "__main__":
    main()
