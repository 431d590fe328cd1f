"""CPU kernels where torch's own ops pay for copies or many passes.

* Paged decode attention that reads the KV pool in place. The torch path
  (`paged_attention_reference`) gathers every sequence's K and V rows into
  dense copies, then runs SDPA over them: on a decode pass the gathers alone
  cost as much as the attention. `cpu_kernels.c` walks each sequence's slots
  in the pool instead, 16 lanes at a time with AVX-512 (8 with AVX2).
* The residual add and RMSNorm in one pass per row (torch's bfloat16
  rms_norm runs as several ops, each a pass over the activations), and
  SwiGLU's silu(gate) * up likewise.
* RoPE of the new queries and keys with the keys and values written
  straight into their pool slots (torch: a roll, two products, a split and
  two index copies).

The C file is compiled at first use with the system's C compiler (`$CC`, or
`cc`) into a cache directory (`$RINGSERVE_CACHE_DIR`, else
`$XDG_CACHE_HOME/ringserve`, else `~/.cache/ringserve`), one library per
source, compiler, flags and CPU, written under a temporary name and renamed
into place, so ranks starting together never load a half-written file. It
is compiled for this machine's CPU (`-march=native`), or for the target
`$RINGSERVE_CPU_MARCH` names (`x86-64-v3`: AVX2, for a library shared by
older machines). Where there is no compiler, the compile fails, or the
target has neither AVX-512 nor AVX2 with FMA, `load` says why in one log
line and returns None: every op stays on the torch path, which gives the
same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

from ringserve.config import cache_dir as default_cache_dir
from ringserve.kernels.batch import ForwardBatch

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-fno-math-errno", "-shared", "-fPIC")
LIBS = ("-lm", "-lpthread")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
BAD_SLOT = 4  # a kernel's status for a slot outside the pool (cpu_kernels.c)
COMPILE_TIMEOUT_S = 120.0


class CpuKernels:
    """The compiled kernels. Each `supports_*` says whether a call can take
    its kernel; `decode_attention` has `paged_attention_reference`'s
    contract for decode passes, `add_rmsnorm` that of `add_rmsnorm_reference`
    (and of `rmsnorm_reference` with no residual), `silu_mul` and
    `rope_store` those of the torch lines they replace."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int64] * 6
            + [ctypes.c_float, ctypes.c_int64, ctypes.c_int64]
        )
        # The bare entry points: no checks. The methods below check each
        # call; `native_pass.NativePass` checks a pass once and calls these.
        self.decode_fn = fn
        norm = library.add_rmsnorm
        norm.restype = ctypes.c_int
        norm.argtypes = (
            [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int64]
        )
        self.norm_fn = norm
        silu = library.silu_mul
        silu.restype = ctypes.c_int
        silu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
        self.silu_fn = silu
        rope = library.rope_store
        rope.restype = ctypes.c_int
        rope.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64,
        ]  # fmt: skip
        self.rope_fn = rope
        self.lanes = int(library.vectorized())  # 16: AVX-512, 8: AVX2, 0: plain loops

    @classmethod
    def load(cls, cache_dir: Path | None = None, march: str | None = None) -> CpuKernels | None:
        """The kernels built for this machine (or for `march`, else
        $RINGSERVE_CPU_MARCH, else native), compiling them when no cached
        build exists; None (with the reason logged) when they cannot be had."""
        wanted = os.environ.get("CC") or "cc"
        compiler = shutil.which(wanted)
        if compiler is None:
            given = f"$CC={wanted}" if os.environ.get("CC") else "cc"
            log.warning("cpu_kernels.torch", reason=f"no C compiler: {given} is not on PATH")
            return None
        try:
            target = march or os.environ.get("RINGSERVE_CPU_MARCH") or "native"
            path = _build(compiler, cache_dir or default_cache_dir(), (f"-march={target}",))
            kernel = cls(ctypes.CDLL(str(path)))
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            log.warning("cpu_kernels.torch", reason=f"the kernel did not build: {exc}")
            return None
        if not kernel.lanes:
            log.warning(
                "cpu_kernels.torch", reason="the target has neither AVX-512 nor AVX2 with FMA"
            )
            return None
        log.info("cpu_kernels.native", library=str(path), lanes=kernel.lanes)
        return kernel

    def supports_decode(self, q: torch.Tensor, k_cache: torch.Tensor, batch: ForwardBatch) -> bool:
        """A decode pass of a storage type and head size the kernel knows."""
        return q.device.type == "cpu" and self.decodes(
            batch, q.dtype, q.shape[1], q.shape[-1], k_cache
        )

    def decodes(
        self, batch: ForwardBatch, dtype: torch.dtype, heads: int, dim: int, k_cache: torch.Tensor
    ) -> bool:
        """`supports_decode` from the queries' dtype and shape ([B, heads, dim])
        alone. The kernel's threads split the sequences: with more threads
        than sequences SDPA, which splits heads too, keeps the pass."""
        return (
            batch.decode_only
            and torch.get_num_threads() <= batch.batch_size
            and dtype in DTYPE_CODES
            and k_cache.dtype == dtype
            and dim % 16 == 0
            and heads % k_cache.shape[1] == 0
            and k_cache.is_contiguous()
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """[B, Hq, D] queries (one per sequence) -> [B, Hq, D] outputs."""
        q = q.contiguous()
        slots, lens = batch.req_slots.contiguous(), batch.seq_lens.contiguous()
        if v_cache.shape != k_cache.shape or not v_cache.is_contiguous():
            raise ValueError("k_cache and v_cache must be contiguous tensors of one shape")
        if q.shape[0] != slots.shape[0] or lens.shape != slots.shape[:1]:
            raise ValueError(
                f"{q.shape[0]} queries and {lens.numel()} lengths for {slots.shape[0]} sequences"
            )
        if slots.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("slots and lengths must be int64")
        return self.decode_into(q, k_cache, v_cache, slots, lens, scale, DTYPE_CODES[q.dtype])

    def decode_into(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        code: int,
    ) -> torch.Tensor:
        """`decode_attention` once its arguments are checked: contiguous
        queries, pool layers, slot table and lengths (int64), one storage
        type (`code`) throughout."""
        out = torch.empty_like(q)
        status = self.decode_fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            slots.data_ptr(),
            lens.data_ptr(),
            slots.shape[0],
            slots.shape[1],
            q.shape[1],
            k_cache.shape[1],
            q.shape[2],
            code,
            scale,
            torch.get_num_threads(),
            k_cache.shape[0],
        )
        if status == BAD_SLOT:
            raise IndexError(
                f"decode attention: a context reaches outside the KV pool of {k_cache.shape[0]} "
                "slots (or past its slot table)"
            )
        if status != 0:
            raise MemoryError(f"CPU decode attention failed (status {status})")
        return out

    def supports_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Rows of a storage type the kernel knows, the weight as long as a row."""
        return (
            x.device.type == "cpu"
            and x.dim() == 2
            and x.dtype in DTYPE_CODES
            and weight.dtype == x.dtype
            and weight.shape == x.shape[-1:]
            and x.is_contiguous()
            and weight.is_contiguous()
        )

    def add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rmsnorm(x + residual), x + residual), as `add_rmsnorm_reference`;
        with no residual, (rmsnorm(x), None) as `rmsnorm_reference`."""
        out = torch.empty_like(x)
        summed = None
        if residual is not None:
            residual = residual.contiguous()
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError("the residual must have the rows' shape and dtype")
            summed = torch.empty_like(x)
        self.norm_into(x, residual, weight, out, summed, eps, DTYPE_CODES[x.dtype])
        return out, summed

    def norm_into(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        out: torch.Tensor,
        summed: torch.Tensor | None,
        eps: float,
        code: int,
    ) -> None:
        """`add_rmsnorm` into `out` (and `summed`) once its arguments are
        checked: contiguous rows of one shape and storage type (`code`)."""
        status = self.norm_fn(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            None if summed is None else summed.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            code,
        )
        if status != 0:
            raise MemoryError(f"CPU add_rmsnorm failed (status {status})")

    def supports_silu_mul(self, gate_up: torch.Tensor) -> bool:
        """[T, 2I] contiguous rows of a storage type the kernel knows."""
        return (
            gate_up.device.type == "cpu"
            and gate_up.dim() == 2
            and gate_up.shape[1] % 2 == 0
            and gate_up.dtype in DTYPE_CODES
            and gate_up.is_contiguous()
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of [T, 2I] rows holding [gate | up]: [T, I]."""
        return self.silu_into(gate_up, DTYPE_CODES[gate_up.dtype])

    def silu_into(self, gate_up: torch.Tensor, code: int) -> torch.Tensor:
        """`silu_mul` once its argument is checked: contiguous [T, 2I] rows
        of storage type `code`."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        status = self.silu_fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, code)
        if status != 0:
            raise MemoryError(f"CPU silu_mul failed (status {status})")
        return out

    def supports_rope_store(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> bool:
        """[T, H, D] heads whose rows are dense (any row stride), tables of
        [T, 1, D], one storage type throughout, contiguous pool layers."""
        dtype = qk.dtype
        return (
            qk.device.type == "cpu"
            and dtype in DTYPE_CODES
            and all(t.dtype == dtype for t in (v, cos, k_cache, v_cache))
            and qk.dim() == 3
            and v.dim() == 3
            and qk.shape[-1] % 2 == 0
            and _dense_rows(qk)
            and _dense_rows(v)
            and cos.is_contiguous()
            and cos.numel() == qk.shape[0] * qk.shape[-1]
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )

    def rope_store(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out_slots: torch.Tensor,
    ) -> torch.Tensor:
        """The rotated queries [T, Hq, D] of `qk` ([T, Hq + Hkv, D]); the
        rotated keys and `v` ([T, Hkv, D]) written at `out_slots` of the pool
        layer, as `apply_rope` then `store_kv_reference`."""
        tokens, heads, dim = qk.shape
        hkv = k_cache.shape[1]
        if v.shape != (tokens, hkv, dim) or heads <= hkv or signed_sin.shape != cos.shape:
            raise ValueError("rope_store: heads, values and tables do not agree")
        slots = out_slots.contiguous()
        if slots.shape != (tokens,) or slots.dtype != torch.int64:
            raise ValueError(f"rope_store: {tokens} tokens need {tokens} int64 slots")
        q_out = torch.empty(tokens, heads - hkv, dim, dtype=qk.dtype)
        status = self.rope_fn(
            qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0),
            cos.data_ptr(), signed_sin.contiguous().data_ptr(), q_out.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            tokens, heads - hkv, hkv, dim, DTYPE_CODES[qk.dtype], k_cache.shape[0],
        )  # fmt: skip
        if status == BAD_SLOT:
            raise IndexError(f"rope_store: a slot lies outside the KV pool of {k_cache.shape[0]}")
        return q_out


def _dense_rows(x: torch.Tensor) -> bool:
    """Each [H, D] row is dense; rows may be any stride apart."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _build(compiler: str, cache_dir: Path, target: tuple[str, ...]) -> Path:
    """The cached library for this source, compiler, target and CPU,
    compiled first when missing."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS + target + LIBS).encode(), version.encode(),
                 platform.machine().encode(), _cpu_flags().encode()):  # fmt: skip
        key.update(part)
    path = cache_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if _whole(path):
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *target, str(SOURCE), "-o", tmp, *LIBS],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, path)
        with tempfile.NamedTemporaryFile("w", dir=cache_dir, delete=False) as note:
            note.write(digest)
        os.replace(note.name, _digest_path(path))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _digest_path(library: Path) -> Path:
    return library.with_suffix(".sha256")


def _whole(library: Path) -> bool:
    """Whether the cached library is the one built (its digest, written
    beside it after it, matches): a damaged one, loaded, could end the
    process (SIGBUS on a truncated file); it is built again instead."""
    try:
        expected = _digest_path(library).read_text().strip()
        return hashlib.sha256(library.read_bytes()).hexdigest() == expected
    except OSError:
        return False


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native compiles for them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
