"""Where a short GPU pass spends its time, for a CUDA machine: one decode
forward of a random-weight Llama at 1B shapes (a few layers, as a short pass
is) through the Triton kernels and through the torch path, timed and
profiled (the ops with the most CPU and the most GPU time, the kernels
launched per forward), the batch building and the sampling beside it; then
the built-in model served by `LLM` on the GPU, its wall time per pass against
the forward's time per pass (what the engine adds around a forward).

    python bench/gpu_profile.py [--layers 4] [--batch 32] [--context 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_load import tokens_per_s, workload  # noqa: E402
from gpu_check import MODELS, backend, build_random_model, cuda_ms, scattered_rows  # noqa: E402

from ringserve import LLM  # noqa: E402
from ringserve.engine.sampler import Sampler  # noqa: E402
from ringserve.kernels.batch import ForwardBatch  # noqa: E402
from ringserve.kernels.sample import sample as triton_sample  # noqa: E402
from ringserve.kernels.sample_cpu import sample_candidates  # noqa: E402
from ringserve.models.decode_graphs import DecodeGraphs  # noqa: E402
from ringserve.ring.messages import SamplingSpec  # noqa: E402


def wall_us(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / iters * 1e6


def forward_profile(args: argparse.Namespace) -> None:
    cfg, model, kv_pool = build_random_model(MODELS["1b"], args.layers)
    rows = scattered_rows(args.batch, args.context)
    pool = kv_pool(cfg.num_layers, args.batch * args.context + 1, cfg.num_kv_heads,
                   cfg.head_dim, torch.bfloat16, "cuda")  # fmt: skip
    sizes, sample = [1] * args.batch, [True] * args.batch
    batch = ForwardBatch.build(rows, sizes, sample, "cuda")
    ids = torch.randint(0, cfg.vocab_size, (args.batch,), device="cuda")
    print(f"decode forward, 1B shapes, {cfg.num_layers} layers, batch {args.batch}, "
          f"context {args.context}, bf16")  # fmt: skip
    print(
        f"  ForwardBatch.build on cuda: {wall_us(lambda: ForwardBatch.build(rows, sizes, sample, 'cuda')):.0f} us"
    )  # noqa: E501
    for which in ("triton", "torch"):
        with backend(which), torch.inference_mode():

            def step():
                return model.logits(model(ids, batch, pool)[batch.sample_rows])

            gpu = cuda_ms(step, 3, 20)
            wall = wall_us(step, 20) / 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            logits = step()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA") / 5
        print(f"\n== {which}: {wall:.2f} ms wall, {gpu:.2f} ms by CUDA events a forward, "
              f"{kernels:.0f} kernels launched a forward")  # fmt: skip
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
        print(table)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=6))
    graphs = DecodeGraphs(model, pool, torch.device("cuda"), first=True, max_rows=args.batch)
    id_list = ids.tolist()

    def replayed():
        with torch.inference_mode():
            graphs.batch(rows, sample)
            hidden = graphs.forward(id_list, None)
            return model.logits(hidden[batch.sample_rows])

    replayed()  # captures
    torch.testing.assert_close(replayed(), logits, rtol=2e-2, atol=2e-2)
    print(f"\n== CUDA graph: {wall_us(replayed, 20) / 1e3:.2f} ms wall a forward, its batch "
          f"written and copied in (same logits as the eager forward)")  # fmt: skip
    sampler = Sampler()
    greedy = [SamplingSpec(temperature=0.0)] * args.batch
    spec = [SamplingSpec(temperature=0.8, top_p=0.9, seed=1)] * args.batch
    pos = [args.context] * args.batch
    print(f"sampling {args.batch} rows of {cfg.vocab_size}: greedy "
          f"{wall_us(lambda: sampler(0, logits, greedy, pos), 20):.0f} us, top-p "
          f"{wall_us(lambda: sampler(0, logits, spec, pos), 5):.0f} us")  # fmt: skip
    # the CPU's head-of-order sampling is plain torch: on the GPU beside the
    # whole-row sort and the Triton kernel, on the same noise
    n, dev = logits.shape[0], logits.device
    params = (torch.full((n,), 0.8, device=dev), torch.zeros(n, dtype=torch.int64, device=dev),
              torch.full((n,), 0.9, device=dev), torch.zeros(n, device=dev))  # fmt: skip
    noise = torch.rand(logits.shape, device=dev)
    same = torch.equal(triton_sample(logits, *params, noise)[0],
                       sample_candidates(logits, *params, noise)[0])  # fmt: skip
    print(f"top-p kernels alone: sort + Triton "
          f"{wall_us(lambda: triton_sample(logits, *params, noise), 20):.0f} us, head of each "
          f"row {wall_us(lambda: sample_candidates(logits, *params, noise), 20):.0f} us "
          f"(same tokens: {same})")  # fmt: skip


def engine_profile(args: argparse.Namespace) -> None:
    """The built-in model on the GPU, decode passes replayed as CUDA graphs
    against op by op (`enforce_eager`), each warmed up first (Triton
    compiles, graphs captured) at the measured batch."""
    for eager in (False, True):
        with LLM(device="cuda", max_batch=args.batch, enforce_eager=eager) as llm:
            conductor = llm._ring.conductor
            vocab = conductor.vocab_size
            tokens_per_s(llm, workload(args.batch, vocab, -1), 64)
            stage = conductor.stage
            n0, s0 = stage.forwards, stage.forward_s
            began = time.perf_counter()
            rate = tokens_per_s(llm, workload(args.batch, vocab, 0), 64)
            wall = time.perf_counter() - began
            n, spent = stage.forwards - n0, stage.forward_s - s0
        how = "eager" if eager else "CUDA graphs"
        print(f"\n== built-in model, LLM on cuda, {how}, {args.batch} requests x 64 tokens: "
              f"{rate:.0f} tok/s, {n} passes, {wall / n * 1e3:.2f} ms wall a pass, forward "
              f"{spent / n * 1e3:.2f} ms a pass ({spent / wall:.2f} of the wall)")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device visible", file=sys.stderr)
        return 3
    failed = 0
    for part in (forward_profile, engine_profile):
        try:
            part(args)
        except Exception as exc:  # report it and measure the rest
            print(f"{part.__name__}: failed: {exc!r}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
