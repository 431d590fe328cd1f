"""One rank against the machine's limit: decode throughput of one rank
beside a bare loop of the same weight matmuls, measured interleaved in one run.

Model: the ~111M-parameter Llama of `tests/model_factory.llama_100m` (hidden
1024, 8 layers, 16 heads / 8 KV heads, intermediate 2816, vocab 8192), written
once under --model-dir. For each dtype, with one torch thread:

* engine:  `LLM(model, pp_size=1)` decoding `--batch` concurrent greedy
           requests (scheduler, caches, sampler included), its decode
           attention reading the KV pool in place (`--cpu-kernels
           native`). Decode time is the time of a run generating 1 + N
           tokens less that of a run generating 1 token from prompts of the
           same length, so prefill is left out.
* torch:   the same engine with `--cpu-kernels torch` (K/V rows gathered
           out of the pool, then SDPA).
* forward: the model slice's decode forward in a loop (batch building,
           layers, head, argmax): the engine without its scheduler, native
           attention, weights packed as the engine packs them.
* matmuls: per layer the q, k, v, o, gate, up and down matmuls at the same
           batch and dtype, plus the lm head: what a decode step must pay,
           through `F.linear` on plain weights;
* packed:  the same matmuls on weights packed by `kernels/packed_linear.py`
           (bfloat16; float32 weights are not packed, so it equals matmuls).
           The ratios are taken against the faster of the two loops.

Usage:
    PYTHONPATH=. .venv/bin/python bench/roofline.py [--dtypes float32 bfloat16]
        [--batch 32] [--prompt-len 32] [--new-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringserve import LLM, SamplingParams  # noqa: E402
from ringserve.cache.pool import KVPool  # noqa: E402
from ringserve.kernels import packed_linear  # noqa: E402
from ringserve.kernels.batch import ForwardBatch  # noqa: E402
from ringserve.kernels.cpu_native import CpuKernels  # noqa: E402
from ringserve.models.config import ModelConfig  # noqa: E402
from ringserve.models.loader import load_model  # noqa: E402
from tests.model_factory import llama_100m  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_dir(root: Path) -> Path:
    path = root / "llama_100m"
    if not (path / "config.json").is_file():
        llama_100m(root)
    return path


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


class Clock:
    """Wall and process CPU seconds since it was made. On a machine shared
    with other work, CPU time is the steadier measure of what a loop costs."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def rates(self, tokens: int) -> tuple[float, float]:
        """(wall tok/s, CPU tok/s) for `tokens` made since the clock started."""
        return tokens / (time.perf_counter() - self.wall), tokens / (time.process_time() - self.cpu)


def engine_decode(
    llm: LLM, batch: list[list[int]], again: list[list[int]], new: int
) -> tuple[float, float]:
    """Decode (wall, CPU) tok/s: generating 1 + new tokens from `batch`, less
    generating one token from `again` (fresh prompts of the same length, so
    no prefix hit)."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + new, temperature=0, ignore_eos=True)
    clock = Clock()
    llm.generate(again, one, use_tqdm=False)
    short = (time.perf_counter() - clock.wall, time.process_time() - clock.cpu)
    clock = Clock()
    outs = llm.generate(batch, many, use_tqdm=False)
    long = (time.perf_counter() - clock.wall, time.process_time() - clock.cpu)
    assert all(len(o.token_ids) == 1 + new for o in outs)
    return tuple(len(batch) * new / (b - a) for a, b in zip(short, long, strict=True))


class ForwardLoop:
    """The model slice's decode steps, with no scheduler: the same tensors
    the runner builds, sampled greedily."""

    def __init__(self, model_path: Path, dtype: torch.dtype, bsz: int, context: int) -> None:
        self.cfg = ModelConfig.from_dir(model_path)
        self.model = load_model(model_path, self.cfg, range(self.cfg.num_layers), dtype)
        self.model.pack_linear_weights()
        cfg = self.cfg
        self.pool = KVPool(cfg.num_layers, bsz * context + 1, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.bsz, self.context = bsz, context
        self.native = CpuKernels.load()

    @torch.inference_mode()
    def run(self, prompt_len: int, steps: int) -> tuple[float, float]:
        rows = [list(range(1 + b * self.context, 1 + b * self.context + prompt_len))
                for b in range(self.bsz)]  # fmt: skip
        tokens = torch.randint(3, self.cfg.vocab_size, (self.bsz,))
        clock = Clock()
        for _ in range(steps):
            for row in rows:
                row.append(row[-1] + 1)
            batch = ForwardBatch.build(rows, [1] * self.bsz, [True] * self.bsz, native=self.native)
            hidden = self.model(tokens, batch, self.pool)
            tokens = self.model.logits(hidden[batch.sample_rows]).max(-1).indices
        return clock.rates(self.bsz * steps)


class MatmulLoop:
    """Per layer the seven projection matmuls of a decode step, then the lm
    head, on random weights of the model's shapes."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, bsz: int, packed: bool) -> None:
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.q_size, cfg.kv_size

        def w(out: int, inp: int) -> torch.Tensor:
            weight = torch.randn(out, inp, dtype=dtype) * 0.02
            return (
                packed_linear.pack(weight) if packed and packed_linear.can_pack(weight) else weight
            )

        shapes = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q)]
        shapes += [(inter, hidden), (inter, hidden), (hidden, inter)]
        self.layers = [[w(*s) for s in shapes] for _ in range(cfg.num_layers)]
        self.head = w(cfg.vocab_size, hidden)
        self.inputs = {n: torch.randn(bsz, n, dtype=dtype) for n in (hidden, q, inter)}
        self.bsz = bsz

    @torch.inference_mode()
    def run(self, steps: int) -> tuple[float, float]:
        clock = Clock()
        for _ in range(steps):
            for weights in self.layers:
                for weight in weights:
                    packed_linear.linear(self.inputs[weight.shape[1]], weight)
            packed_linear.linear(self.inputs[self.head.shape[1]], self.head)
        return clock.rates(self.bsz * steps)


def measure(path: Path, dtype: str, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) tok/s of each loop, the loops interleaved."""
    cfg = ModelConfig.from_dir(path)
    bare = MatmulLoop(cfg, DTYPES[dtype], args.batch, packed=False)
    packed = MatmulLoop(cfg, DTYPES[dtype], args.batch, packed=True)
    fwd = ForwardLoop(path, DTYPES[dtype], args.batch, args.prompt_len + args.new_tokens + 1)
    engines = {
        name: LLM(path, pp_size=1, dtype=dtype, torch_threads=1, cpu_kernels=choice)
        for name, choice in (("engine", "native"), ("torch", "torch"))
    }
    try:
        seed = 0
        for llm in engines.values():
            engine_decode(llm, *(prompts(args.batch, args.prompt_len, cfg.vocab_size, s)
                                 for s in (seed, seed + 1)), 4)  # fmt: skip
        bare.run(4)
        packed.run(4)
        fwd.run(args.prompt_len, 4)
        runs: dict[str, list[tuple[float, float]]] = {
            "engine": [], "torch": [], "forward": [], "matmuls": [], "packed": []
        }  # fmt: skip
        for r in range(args.repeats):
            seed = 2 * (r + 1)
            first, second = (prompts(args.batch, args.prompt_len, cfg.vocab_size, s)
                             for s in (seed, seed + 1))  # fmt: skip
            runs["matmuls"].append(bare.run(args.new_tokens))
            runs["packed"].append(packed.run(args.new_tokens))
            for name, llm in engines.items():
                runs[name].append(engine_decode(llm, first, second, args.new_tokens))
            runs["forward"].append(fwd.run(args.prompt_len, args.new_tokens))
            runs["packed"].append(packed.run(args.new_tokens))
            runs["matmuls"].append(bare.run(args.new_tokens))
    finally:
        for llm in engines.values():
            llm.close()
    return {k: tuple(statistics.median(r[i] for r in v) for i in (0, 1)) for k, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/ringserve-bench"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = model_dir(args.model_dir)
    print(f"model {path}, batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} decode steps, 1 torch thread")  # fmt: skip
    print("tok/s, median of the repeats; ratios against the faster matmul loop (matmuls, packed)")
    print(
        f"{'dtype':<10}{'clock':<6}{'engine':>9}{'torch':>9}{'forward':>9}{'matmuls':>9}"
        f"{'packed':>9}{'engine/mm':>11}{'torch/mm':>10}{'fwd/mm':>8}"
    )
    for dtype in args.dtypes:
        tps = measure(path, dtype, args)
        for i, clock in enumerate(("wall", "cpu")):
            eng, tor, fwd, mm, pk = (
                tps[k][i] for k in ("engine", "torch", "forward", "matmuls", "packed")
            )
            best = max(mm, pk)
            print(
                f"{dtype:<10}{clock:<6}{eng:>9.1f}{tor:>9.1f}{fwd:>9.1f}{mm:>9.1f}{pk:>9.1f}"
                f"{eng / best:>11.2f}{tor / best:>10.2f}{fwd / best:>8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
