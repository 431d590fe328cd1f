"""One-shot GPU check, for a machine with a CUDA device, in under ten minutes:

1. the kernel test files and the engine's GPU tests (`tests/test_gpu_*.py`:
   greedy equality with transformers on CUDA, at pp 1 and pp 2) run
   natively on CUDA (TRITON_INTERPRET=0 in the child, so the kernels compile
   for the GPU rather than the interpreter);
2. decode attention, Triton against the torch reference, at Llama-8B
   attention shapes (32 heads, 8 KV heads, head_dim 128, bfloat16);
3. end-to-end forward throughput of random-weight Llama models at 1B-like and
   8B-like shapes, Triton path against torch path, and decode passes replayed
   as CUDA graphs (`graph_ms`) (skipped, with the reason,
   when ringserve.models cannot build one).

The torch path on CUDA is reached by patching `ops.uses_triton`, the one
switch every call site goes through, for the duration of a measurement.

    python bench/gpu_check.py [--skip-tests] [--skip-e2e] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringserve.kernels import ops  # noqa: E402
from ringserve.kernels.attention_reference import paged_attention_reference  # noqa: E402
from ringserve.kernels.batch import ForwardBatch  # noqa: E402
from ringserve.kernels.decode_attention import decode_attention  # noqa: E402

NO_CUDA_EXIT = 3  # argparse already exits 2 on bad arguments
LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
LLAMA_8B = LLAMA_1B | {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "head_dim": 128,
    "intermediate_size": 14336,
    "tie_word_embeddings": False,
}
MODELS = {"1b": LLAMA_1B, "8b": LLAMA_8B}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Kernel tests and benchmarks on a CUDA device.")
    p.add_argument("--skip-tests", action="store_true", help="do not run the kernel tests")
    p.add_argument("--skip-decode", action="store_true", help="skip the decode benchmark")
    p.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end benchmark")
    p.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    p.add_argument("--models", default="1b,8b", help="end-to-end shapes, of: 1b, 8b")
    p.add_argument("--layers", type=int, default=0, help="cap layers per model (0: all)")
    p.add_argument("--test-timeout", type=int, default=300, help="seconds for the test run")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown model shapes {sorted(unknown)}; choose from {sorted(MODELS)}")
    return args


GPU_TESTS = ("test_kernels_*.py", "test_gpu_*.py")  # the kernels, then the engine on a GPU


def kernel_test_command() -> tuple[list[str], dict[str, str]]:
    """The native test run: every kernel test file and the engine's GPU
    tests. conftest only sets TRITON_INTERPRET when it is unset, so the
    child gets 0 explicitly: the kernels compile for CUDA and the tests'
    kernel device becomes CUDA."""
    env = os.environ | {"TRITON_INTERPRET": "0"}
    tests = ROOT / "tests"
    files = sorted(str(p.relative_to(ROOT)) for g in GPU_TESTS for p in tests.glob(g))
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []  # compiles in parallel
    return [sys.executable, "-m", "pytest", "-q", "-rs", *workers, *files], env


def run_kernel_tests(timeout: int) -> bool:
    cmd, env = kernel_test_command()
    print(f"== kernel and engine tests on CUDA: {' '.join(cmd[3:])}", flush=True)
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"kernel tests ran past {timeout}s", flush=True)
        return False
    return done.returncode == 0


def cuda_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def scattered_rows(num_seqs: int, context: int) -> list[list[int]]:
    """Every sequence's context at randomly permuted slots, as a paged pool has them."""
    perm = torch.randperm(num_seqs * context) + 1
    return perm.view(num_seqs, context).tolist()


def bench_decode(quick: bool) -> list[dict]:
    shapes = (
        [(32, 1024), (128, 4096)]
        if quick
        else [(b, c) for b in (32, 64, 128) for c in (1024, 2048, 4096)]
    )
    results = []
    for bsz, context in shapes:
        results.append(decode_figures(bsz, context))
        torch.cuda.empty_cache()
    return results


def decode_figures(bsz: int, context: int) -> dict:
    """One decode step of `bsz` sequences of `context` tokens at Llama-8B
    attention shapes (32 heads, 8 KV heads, head_dim 128, bfloat16)."""
    heads, kv_heads, head_dim = 32, 8, 128
    batch = ForwardBatch.build(scattered_rows(bsz, context), [1] * bsz, [True] * bsz, "cuda")
    k = torch.randn(bsz * context + 1, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(bsz, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    scale = head_dim**-0.5
    triton_ms = cuda_ms(lambda: decode_attention(q, k, v, batch, scale), 3, 20)
    torch_ms = cuda_ms(lambda: paged_attention_reference(q, k, v, batch, scale), 2, 5)
    out = decode_attention(q, k, v, batch, scale).float()
    err = (out - paged_attention_reference(q, k, v, batch, scale).float()).abs().max()
    kv_bytes = 2 * bsz * context * kv_heads * head_dim * k.element_size()
    return {
        "batch": bsz,
        "context": context,
        "triton_us": triton_ms * 1e3,
        "torch_us": torch_ms * 1e3,
        "speedup": torch_ms / triton_ms,
        "triton_GB_s": kv_bytes / triton_ms / 1e6,
        "max_abs_err": float(err),
    }


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Route ops through the Triton kernels ("triton") or the references ("torch")."""
    if name == "triton":
        yield
        return
    with mock.patch.object(ops, "uses_triton", lambda device: False):
        yield


def build_random_model(cfg_dict: dict, layers: int):
    from ringserve.cache.pool import KVPool
    from ringserve.models import build_model
    from ringserve.models.config import ModelConfig

    if layers:
        cfg_dict = cfg_dict | {"num_hidden_layers": min(layers, cfg_dict["num_hidden_layers"])}
    cfg = ModelConfig.from_dict(cfg_dict)
    model = build_model(cfg, range(cfg.num_layers), torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    return cfg, model, KVPool


def model_passes(quick: bool) -> tuple[int, dict[str, tuple[list[list[int]], list[int]]]]:
    """Pool capacity and the two passes timed: a prefill of whole prompts and a
    decode step over long contexts, all at scattered slots."""
    prefill_seqs, prompt = (2, 512) if quick else (4, 1024)
    decode_seqs, context = (32, 512) if quick else (64, 1024)
    rows = scattered_rows(1, prefill_seqs * prompt + decode_seqs * context)[0]
    split = prefill_seqs * prompt
    prefill = [rows[i * prompt : (i + 1) * prompt] for i in range(prefill_seqs)]
    decode = [rows[split + i * context : split + (i + 1) * context] for i in range(decode_seqs)]
    passes = {"prefill": (prefill, [prompt] * prefill_seqs), "decode": (decode, [1] * decode_seqs)}
    return len(rows) + 1, passes


def bench_model(name: str, layers: int, quick: bool) -> list[dict]:
    cfg, model, kv_pool = build_random_model(MODELS[name], layers)
    capacity, passes = model_passes(quick)
    pool = kv_pool(cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    results = []
    for kind, (rows, extend) in passes.items():
        batch = ForwardBatch.build(rows, extend, [True] * len(rows), "cuda")
        ids = torch.randint(0, cfg.vocab_size, (batch.num_tokens,), device="cuda")
        row = {"model": name, "layers": cfg.num_layers, "pass": kind, "tokens": batch.num_tokens}
        for which in ("triton", "torch"):
            ms = time_forward(model, pool, batch, ids, which, 3 if quick else 8)
            row[f"{which}_ms"] = ms
            row[f"{which}_tok_s"] = batch.num_tokens / ms * 1e3
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        row["graph_ms"] = float("nan")  # prefill passes run eagerly
        if kind == "decode":
            row["graph_ms"] = time_graph(model, pool, rows, ids, 3 if quick else 8)
        results.append(row)
    return results


def time_graph(model, pool, rows: list[list[int]], ids: torch.Tensor, iters: int) -> float:
    """Milliseconds of a decode pass replayed as a CUDA graph, its batch
    written into the static buffers each time, plus its logits."""
    from ringserve.models.decode_graphs import DecodeGraphs

    graphs = DecodeGraphs(model, pool, torch.device("cuda"), first=True, max_rows=len(rows))
    id_list, sample = ids.tolist(), [True] * len(rows)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            batch = graphs.batch(rows, sample)
            return model.logits(graphs.forward(id_list, None)[batch.sample_rows])

    return cuda_ms(step, 2, iters)


def time_forward(model, pool, batch: ForwardBatch, ids: torch.Tensor, which: str, iters: int):
    """Milliseconds of one forward pass plus the logits of its sampled rows."""

    def step() -> torch.Tensor:
        return model.logits(model(ids, batch, pool)[batch.sample_rows])

    with backend(which), torch.inference_mode():
        return cuda_ms(step, 2, iters)


def bench_e2e(models: list[str], layers: int, quick: bool) -> list[dict]:
    results = []
    for name in models:
        try:
            results += bench_model(name, layers, quick)
            torch.cuda.empty_cache()
        except Exception as exc:  # the model code is optional here; report it, keep going
            print(f"end-to-end {name}: not measured: {exc!r}", flush=True)
    return results


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    cells = [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(f"\n== {title}")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device visible; this script only runs on a GPU machine "
            "(the CPU suite runs the kernels under TRITON_INTERPRET=1 instead)",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    began = time.monotonic()
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    tests_ok = True if args.skip_tests else run_kernel_tests(args.test_timeout)
    figures = {"tests_passed": tests_ok}
    if not args.skip_decode:
        figures["decode"] = bench_decode(args.quick)
        print_table("decode attention, 32 heads / 8 KV heads / d128, bf16", figures["decode"])
    if not args.skip_e2e:
        figures["e2e"] = bench_e2e(args.models.split(","), args.layers, args.quick)
        print_table("end-to-end forward + logits, random-weight Llama, bf16", figures["e2e"])
    print(f"\ntests {'passed' if tests_ok else 'FAILED'}; {time.monotonic() - began:.0f}s in all")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if tests_ok else 1


if __name__ == "__main__":
    sys.exit(main())
