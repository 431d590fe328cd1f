"""Checks the Triton wrappers share: where kernels launch, and the shape,
dtype and stride contracts every wrapper enforces before launching one."""

from __future__ import annotations

import os

import torch
import triton.language as tl

from ringserve.kernels.batch import ForwardBatch

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter in this process
    (fixed before the first kernel is decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_device() -> torch.device:
    """The device Triton kernels launch on here: the CPU under the
    interpreter, CUDA otherwise."""
    return torch.device("cpu" if interpreting() else "cuda")


def dot_dtype(t: torch.Tensor) -> tl.dtype:
    """The dtype attention kernels cast K, V and q to as they load them, and
    feed to `tl.dot`. On CUDA half types go to the tensor cores as they are.
    On the CPU only the interpreter runs kernels, and its half-type arithmetic
    is wrong, so values are upcast to float32 straight after the load."""
    if t.device.type == "cpu" or t.dtype == torch.float32:
        return tl.float32
    return tl_dtype(t)


def dot_precision(t: torch.Tensor) -> str:
    """float32 operands multiply exactly ("ieee"), not in TF32, so fp32 runs
    match the reference; half operands use the tensor cores' own precision."""
    return "ieee" if dot_dtype(t) == tl.float32 else "tf32"


def tl_dtype(t: torch.Tensor) -> tl.dtype:
    if t.dtype not in _TL_DTYPES:
        raise TypeError(f"Triton kernels take float32, float16 or bfloat16, not {t.dtype}")
    return _TL_DTYPES[t.dtype]


def require(cond: bool, message: str) -> None:
    """A wrapper's contract check: raises ValueError naming what is wrong."""
    if not cond:
        raise ValueError(message)


def require_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    require(tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}")


def require_inner_contiguous(t: torch.Tensor, name: str) -> None:
    """The last dimension must be dense; other strides may be anything."""
    require(
        t.shape[-1] <= 1 or t.stride(-1) == 1,
        f"{name} must have a unit stride in its last dimension, has strides {t.stride()}",
    )


def require_same_device(name_to_tensor: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in name_to_tensor.items()}
    require(
        len(set(devices.values())) == 1,
        f"tensors are on different devices: {devices}",
    )


def require_index(t: torch.Tensor, name: str) -> None:
    require(
        t.dtype in (torch.int32, torch.int64),
        f"{name} must be an int32 or int64 index tensor, is {t.dtype}",
    )


def require_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """A layer's pool: [capacity, Hkv, D] with dense [Hkv, D] rows, K and V alike."""
    require(k_cache.dim() == 3, f"k_cache must be [capacity, Hkv, D], has shape {k_cache.shape}")
    require_shape(v_cache, tuple(k_cache.shape), "v_cache")
    require(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(
            t.stride(2) == 1 and t.stride(1) == t.shape[2],
            f"{name} rows must be dense [Hkv, D], strides are {t.stride()}",
        )
    require(k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ")
    tl_dtype(k_cache)


def require_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
) -> None:
    """Queries [T, Hq, D] (dense head_dim) over a pool whose Hkv divides Hq,
    with the batch's index tensors on the same device."""
    require_pool(k_cache, v_cache)
    require(q.dim() == 3, f"q must be [T, Hq, D], has shape {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    require(num_tokens == batch.num_tokens, f"q has {num_tokens} rows, batch {batch.num_tokens}")
    require(head_dim == k_cache.shape[2], f"q head_dim {head_dim} != pool {k_cache.shape[2]}")
    require(
        num_heads % k_cache.shape[1] == 0,
        f"{num_heads} query heads are not a multiple of {k_cache.shape[1]} KV heads",
    )
    require_inner_contiguous(q, "q")
    require_inner_contiguous(batch.req_slots, "batch.req_slots")
    for name in ("req_slots", "seq_lens", "extend_lens", "qo_indptr"):
        require_index(getattr(batch, name), f"batch.{name}")
    require_same_device(
        {"q": q, "k_cache": k_cache, "v_cache": v_cache, "req_slots": batch.req_slots}
    )
    tl_dtype(q)
