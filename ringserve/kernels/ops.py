"""The one switch between kernel backends: every call site in the models and
the runner goes through these functions, which pick the Triton kernel for
CUDA tensors and the torch reference otherwise. Tests reach the Triton
wrappers on CPU tensors (under TRITON_INTERPRET=1) by calling them directly."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ringserve.kernels import decode_attention as decode
from ringserve.kernels import extend_attention as extend
from ringserve.kernels import rmsnorm as triton_norm
from ringserve.kernels import sample as triton_sample
from ringserve.kernels import store_kv as triton_store
from ringserve.kernels.attention_bounded import paged_attention_bounded
from ringserve.kernels.attention_reference import paged_attention_reference, store_kv_reference
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.cpu_native import CpuKernels
from ringserve.kernels.norm_reference import add_rmsnorm_reference, rmsnorm_reference
from ringserve.kernels.sample_cpu import sample_candidates


def uses_triton(device: torch.device) -> bool:
    """The switch: tensors on `device` go to the Triton kernels."""
    return device.type == "cuda"


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes `device` the calling thread's current GPU for a block: Triton
    launches on the current device, whatever its tensors' device, and a
    forward runs in an executor thread that never chose one. Nothing
    elsewhere."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    if uses_triton(k_cache.device):
        triton_store.store_kv(k_cache, v_cache, out_slots, k, v)
    else:
        store_kv_reference(k_cache, v_cache, out_slots, k, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    if not uses_triton(q.device):
        native = batch.native
        if native is None:
            return _gathering(q, k_cache, v_cache, batch, scale)
        if batch.decode_only:
            return _cpu_decode(native, q, k_cache, v_cache, batch, scale)
        # A pass that mixes decoding and extending sequences: each kind apart
        parts = batch.mixed_parts()
        if parts.decode is None:
            return _gathering(q, k_cache, v_cache, batch, scale)
        out = torch.empty_like(q)
        rows = parts.decode_rows
        out[rows] = _cpu_decode(native, q[rows], k_cache, v_cache, parts.decode, scale)
        if parts.extend is not None:
            rows = parts.extend_rows
            out[rows] = _gathering(q[rows], k_cache, v_cache, parts.extend, scale)
        return out
    if batch.decode_only:
        return decode.decode_attention(q, k_cache, v_cache, batch, scale)
    return extend.extend_attention(q, k_cache, v_cache, batch, scale)


def _gathering(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Attention through torch, which copies contexts out of the pool:
    within the batch's gather limit where it has one (on the CPU: the tiles
    use torch's CPU flash attention)."""
    if batch.gather_limit is None or q.device.type != "cpu":
        return paged_attention_reference(q, k_cache, v_cache, batch, scale)
    return paged_attention_bounded(q, k_cache, v_cache, batch, scale, batch.gather_limit)


def _cpu_decode(
    native: CpuKernels,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    if native.supports_decode(q, k_cache, batch):
        return native.decode_attention(q, k_cache, v_cache, batch, scale)
    return _gathering(q, k_cache, v_cache, batch, scale)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, native: CpuKernels | None = None
) -> torch.Tensor:
    """`native`: the CPU kernels, where the caller has them."""
    if uses_triton(x.device):
        return triton_norm.rmsnorm(x, weight, eps)
    if native is not None and native.supports_norm(x, weight):
        return native.add_rmsnorm(x, None, weight, eps)[0]
    return rmsnorm_reference(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    native: CpuKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual)."""
    if uses_triton(x.device):
        return triton_norm.add_rmsnorm(x, residual, weight, eps)
    if native is not None and native.supports_norm(x, weight):
        normed, summed = native.add_rmsnorm(x, residual, weight, eps)
        assert summed is not None
        return normed, summed
    return add_rmsnorm_reference(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor, native: CpuKernels | None = None) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of [T, 2I] rows holding [gate | up]."""
    if native is not None and native.supports_silu_mul(gate_up):
        return native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [S] int64, fallback [S] bool); see `sample_reference`."""
    if uses_triton(logits.device):
        return triton_sample.sample(logits, temperature, top_k, top_p, min_p, noise)
    return sample_candidates(logits, temperature, top_k, top_p, min_p, noise)
