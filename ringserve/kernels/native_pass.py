"""The CPU kernels bound to one pass: checked once, then called bare layer
after layer.

`CpuKernels`' wrappers check each call's shapes, dtypes and layouts, and the
model's ops check once more which backend takes the call. Every layer of a
pass sees the same row count, widths, dtype and layouts, so those checks
repeat a layer's answer a dozen times a layer; on a decode pass of a small
model they cost as much as the norms they guard (a ~111M Llama in bfloat16
at 32 rows: 1.1-1.6 ms of a 30 ms step). `NativePass.bind` checks what a
pass's layers share, once, or returns None when anything does not fit (the
layers then take the checked path); its methods allocate their outputs and
call the kernels with nothing else.

What `bind` cannot see, it relies on: a layer's activations are what
`F.linear` and these kernels return (dense rows), its norm weights are the
model's own (one dtype, `[hidden]`, contiguous: `ModelSlice` makes them so),
and every pool layer is shaped, typed and laid out as the one it is shown
(`KVPool` makes them so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.kernels import ops
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.cpu_native import BAD_SLOT, DTYPE_CODES, CpuKernels


@dataclass(slots=True)
class NativePass:
    """One pass's rows on the CPU kernels. Invariant: `code` is the dtype of
    the rows, the rope tables and the pool layers; `cos`/`sin` hold one row
    per token; `decode` says the native decode attention takes the pass
    (`CpuKernels.decodes`), otherwise attention goes through `ops`."""

    kernels: CpuKernels
    batch: ForwardBatch
    code: int
    eps: float
    cos: torch.Tensor  # [T, 1, D], contiguous
    sin: torch.Tensor  # [T, 1, D], contiguous, first half negated (rope.py)
    out_slots: torch.Tensor  # [T] int64, contiguous
    capacity: int  # slots in each pool layer
    decode: bool

    @classmethod
    def bind(
        cls,
        kernels: CpuKernels,
        batch: ForwardBatch,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        pool_layer: torch.Tensor,
        heads: tuple[int, int, int],
        eps: float,
    ) -> NativePass | None:
        """The pass of rows `x` ([T, hidden]) with `rope`'s tables over pool
        layers shaped and typed as `pool_layer`, for (query heads, KV heads,
        head size); None where the kernels cannot take all of it."""
        hq, hkv, dim = heads
        code = DTYPE_CODES.get(x.dtype)
        cos, sin = rope
        tokens = x.shape[0] if x.dim() == 2 else -1
        if (
            code is None
            or x.device.type != "cpu"
            or not x.is_contiguous()
            or dim % 2
            or hq % hkv
            or pool_layer.dtype != x.dtype
            or not pool_layer.is_contiguous()
            or pool_layer.shape[1:] != (hkv, dim)
            or any(t.dtype != x.dtype or t.shape != (tokens, 1, dim) for t in rope)
            or batch.out_slots.shape != (tokens,)
            or batch.out_slots.dtype != torch.int64
        ):
            return None
        decode = (  # the checked path copies slots and lengths that are not so
            kernels.decodes(batch, x.dtype, hq, dim, pool_layer)
            and batch.req_slots.is_contiguous()
            and batch.seq_lens.is_contiguous()
            and batch.req_slots.dtype == batch.seq_lens.dtype == torch.int64
        )
        return cls(
            kernels, batch, code, eps, cos.contiguous(), sin.contiguous(),
            batch.out_slots.contiguous(), pool_layer.shape[0], decode,
        )  # fmt: skip

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rmsnorm(x) of [T, hidden] rows."""
        out = torch.empty_like(x)
        self.kernels.norm_into(x, None, weight, out, None, self.eps, self.code)
        return out

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual) of [T, hidden] rows."""
        out, summed = torch.empty_like(x), torch.empty_like(x)
        self.kernels.norm_into(x, residual, weight, out, summed, self.eps, self.code)
        return out, summed

    def rope_store(
        self, qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """The rotated queries [T, Hq, D] of `qk` ([T, Hq + Hkv, D] of dense
        rows, any row stride); the rotated keys and `v` ([T, Hkv, D], dense
        rows) written at the pass's slots of the pool layer."""
        tokens, heads, dim = qk.shape
        hkv = k_cache.shape[1]
        q = torch.empty(tokens, heads - hkv, dim, dtype=qk.dtype)
        status = self.kernels.rope_fn(
            qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0),
            self.cos.data_ptr(), self.sin.data_ptr(), q.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), self.out_slots.data_ptr(),
            tokens, heads - hkv, hkv, dim, self.code, self.capacity,
        )  # fmt: skip
        if status == BAD_SLOT:
            raise IndexError(f"rope_store: a slot lies outside the KV pool of {self.capacity}")
        return q

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """[T, Hq, D] queries from `rope_store` -> [T, Hq, D] outputs."""
        if not self.decode:
            return ops.paged_attention(q, k_cache, v_cache, self.batch, scale)
        batch = self.batch
        return self.kernels.decode_into(
            q, k_cache, v_cache, batch.req_slots, batch.seq_lens, scale, self.code
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of [T, 2I] rows holding [gate | up]: [T, I]."""
        return self.kernels.silu_into(gate_up, self.code)
