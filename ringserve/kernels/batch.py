"""The tensors one forward pass needs, built once per pass from its rows' slots.

A `ForwardBatch` describes B sequences that each extend their context by some
new tokens (a decode step is an extension by one). The new tokens of all
sequences are flattened into T rows, sequence by sequence. Every sequence's
whole context, cached prefix and new tokens alike, is addressed through KV pool
slot indices: the layers write the new K/V rows at `out_slots` first and then
attend over `req_slots`, so attention only ever reads the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ringserve.kernels.cpu_native import CpuKernels


@dataclass(slots=True)
class ForwardBatch:
    """Per-pass metadata. Invariant: `req_slots[b, :seq_lens[b]]` are the
    slots of sequence b's context in order, and its new tokens are the last
    `extend_lens[b]` of them (`out_slots` lists them flattened)."""

    positions: torch.Tensor  # [T] int64, position of each new token
    out_slots: torch.Tensor  # [T] int64, pool slot each new token writes
    req_slots: torch.Tensor  # [B, L] int64, context slots, padded with slot 0
    seq_lens: torch.Tensor  # [B] int64, context length after this pass
    extend_lens: torch.Tensor  # [B] int64, new tokens per sequence
    qo_indptr: torch.Tensor  # [B + 1] int64, offsets of each sequence's rows
    q_index: torch.Tensor  # [B, Q] int64, row of each padded query (0 where padding)
    q_valid: torch.Tensor  # [B, Q] bool, which padded queries are real
    valid_rows: torch.Tensor  # [T] int64, index of each real query in the flattened [B * Q]
    attn_mask: torch.Tensor  # [B, 1, Q, L] bool, True where a query may attend
    sample_rows: torch.Tensor  # [S] int64, rows whose logits are sampled
    max_extend: int
    num_tokens: int
    # the CPU's in-place decode attention, where the runner has one (cpu_native.py)
    native: CpuKernels | None = None
    _parts: MixedParts | None = None  # `mixed_parts`, made once per pass
    # the most context tokens an attention that copies contexts out of the
    # pool may copy at once (attention_bounded.py); None: no bound
    gather_limit: int | None = None
    # (limit, steps) of `attention_bounded.gather_steps`, made once per pass
    gather_plan: tuple[int, list[Any] | None] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def prefix_lens(self) -> torch.Tensor:
        return self.seq_lens - self.extend_lens

    @property
    def decode_only(self) -> bool:
        return self.max_extend == 1

    @classmethod
    def build(
        cls,
        rows: Sequence[Sequence[int]],
        extend_lens: list[int],
        sample: list[bool],
        device: torch.device | str = "cpu",
        native: CpuKernels | None = None,
        gather_limit: int | None = None,
    ) -> ForwardBatch:
        """`rows[b]` is sequence b's full context (prefix then new slots),
        a list or, copied faster, an int64 array (a replica's `SlotRow`);
        `extend_lens[b]` how many of them are new; `sample[b]` whether the
        last new token's logits are sampled. `native`, when given, is the
        kernel CPU decode passes attend with; `gather_limit` bounds what
        attention through torch copies out of the pool at once."""
        if not (len(rows) == len(extend_lens) == len(sample)) or not rows:
            raise ValueError("rows, extend_lens and sample must be equal, non-empty lists")
        seq_lens = [len(r) for r in rows]
        for n, e in zip(seq_lens, extend_lens, strict=True):
            if not 0 < e <= n:
                raise ValueError(f"extend length {e} outside 1..{n}")
        padded = _padded(rows, max(seq_lens))
        lens = np.array(seq_lens, dtype=np.int64)
        dev = torch.device(device)
        if max(extend_lens) == 1:
            batch = cls._decode(padded, lens, sample, dev)
        else:
            ext_t = torch.tensor(extend_lens, dtype=torch.int64)
            req_slots, seq_t = torch.from_numpy(padded), torch.from_numpy(lens)
            batch = cls._extend(req_slots, seq_t, ext_t, torch.tensor(sample), dev)
        batch.native, batch.gather_limit = native, gather_limit
        return batch

    @classmethod
    def _decode(
        cls, padded: np.ndarray, lens: np.ndarray, sample: list[bool], dev: torch.device
    ) -> ForwardBatch:
        """`_extend`'s tensors for a pass of one new token per sequence, made
        in numpy (a numpy op costs a fifth of a small torch op's overhead):
        row b is query b, at position seq_len - 1."""
        bsz, width = padded.shape
        rows = np.arange(bsz + 1, dtype=np.int64)
        last = lens - 1
        arrays = {
            "positions": last,
            "out_slots": padded[rows[:bsz], last],
            "req_slots": padded,
            "seq_lens": lens,
            "extend_lens": np.ones(bsz, dtype=np.int64),
            "qo_indptr": rows,
            "q_index": rows[:bsz, None],
            "q_valid": np.ones((bsz, 1), dtype=np.bool_),
            "valid_rows": rows[:bsz],
            "attn_mask": (np.arange(width) < lens[:, None])[:, None, None, :],
            "sample_rows": np.flatnonzero(sample).astype(np.int64, copy=False),
        }
        tensors = {name: torch.from_numpy(a) for name, a in arrays.items()}
        return cls(**on_device(tensors, dev), max_extend=1, num_tokens=bsz)

    @classmethod
    def _extend(
        cls,
        req_slots: torch.Tensor,
        seq_t: torch.Tensor,
        ext_t: torch.Tensor,
        sample: torch.Tensor,
        dev: torch.device,
    ) -> ForwardBatch:
        """From CPU tensors: slots [B, L], context lengths [B], new tokens
        per sequence [B], and which sequences are sampled [B] bool."""
        bsz, width = req_slots.shape
        q_max = int(ext_t.max())
        indptr = torch.zeros(bsz + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(ext_t, 0)
        prefix = seq_t - ext_t
        qi = torch.arange(q_max, dtype=torch.int64)
        q_valid = qi[None, :] < ext_t[:, None]
        q_index = torch.where(q_valid, indptr[:-1, None] + qi[None, :], 0)
        q_pos = prefix[:, None] + qi[None, :]  # [B, Q] absolute position of each query
        k_pos = torch.arange(width, dtype=torch.int64)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < seq_t[:, None, None]
        )
        positions = q_pos[q_valid]
        out_slots = req_slots[torch.arange(bsz)[:, None], q_pos.clamp(max=width - 1)][q_valid]
        sample_rows = (indptr[1:] - 1)[sample]
        tensors = {
            "positions": positions,
            "out_slots": out_slots,
            "req_slots": req_slots,
            "seq_lens": seq_t,
            "extend_lens": ext_t,
            "qo_indptr": indptr,
            "q_index": q_index,
            "q_valid": q_valid,
            "valid_rows": q_valid.view(-1).nonzero()[:, 0],
            "attn_mask": mask[:, None],
            "sample_rows": sample_rows,
        }
        return cls(**on_device(tensors, dev), max_extend=q_max, num_tokens=int(indptr[-1]))

    def mixed_parts(self) -> MixedParts:
        """This pass's sequences split into those that decode one token and
        those that extend by more, each as a batch of its own (cut to its own
        longest context), with the rows of its queries: attention over one
        padded batch would pad every decoding sequence to the longest
        extension's queries and every extension to the longest context."""
        if self._parts is None:
            self._parts = MixedParts.of(self)
        return self._parts


def on_device(tensors: dict[str, torch.Tensor], dev: torch.device) -> dict[str, torch.Tensor]:
    """A pass's index tensors, built on the CPU, on `dev`: as they are on
    the CPU; elsewhere packed by dtype into one buffer each, copied once and
    viewed apart (a copy per tensor cost a GPU pass 0.9-1.3 ms of host time
    on an H200)."""
    if dev.type == "cpu":
        return tensors
    return packed_copy(tensors, dev)


def packed_copy(tensors: dict[str, torch.Tensor], dev: torch.device) -> dict[str, torch.Tensor]:
    """Each tensor on `dev` as a contiguous view of one copied buffer per dtype."""
    groups: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault(t.dtype, []).append(name)
    out = {}
    for names in groups.values():
        flat = torch.cat([tensors[n].reshape(-1) for n in names]).to(dev)
        at = 0
        for n in names:
            count = tensors[n].numel()
            out[n] = flat[at : at + count].view(tensors[n].shape)
            at += count
    return out


def _padded(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[B, width] int64, row b holding rows[b] then zeros: filled row by row
    in numpy, a third of the time of a tensor made from padded lists (and a
    copy of each row's block where the rows are arrays; one concatenated
    masked store was slower at every width)."""
    out = np.zeros((len(rows), width), dtype=np.int64)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out


@dataclass(frozen=True, slots=True)
class MixedParts:
    """`decode` attends the queries at rows `decode_rows`, `extend` those at
    `extend_rows` (each None when no sequence is of its kind)."""

    decode: ForwardBatch | None
    decode_rows: torch.Tensor
    extend: ForwardBatch | None
    extend_rows: torch.Tensor

    @classmethod
    def of(cls, batch: ForwardBatch) -> MixedParts:
        one = batch.extend_lens == 1
        parts: list[tuple[ForwardBatch | None, torch.Tensor]] = []
        for chosen in (one, ~one):
            seqs = chosen.nonzero()[:, 0]
            parts.append((None, seqs) if seqs.numel() == 0 else sub_batch(batch, seqs))
        (decode, decode_rows), (extend, extend_rows) = parts
        return cls(decode, decode_rows, extend, extend_rows)


def sub_batch(batch: ForwardBatch, seqs: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
    """The batch of `batch`'s sequences `seqs` (indices, in order), cut to
    their own longest context, and the rows of its queries in `batch`."""
    seq_t = batch.seq_lens[seqs].cpu()
    slots = batch.req_slots[seqs, : int(seq_t.max())].cpu()
    ext_t = batch.extend_lens[seqs].cpu()
    none = torch.zeros(len(seqs), dtype=torch.bool)
    sub = ForwardBatch._extend(slots, seq_t, ext_t, none, batch.req_slots.device)
    sub.gather_limit = batch.gather_limit
    return sub, batch.q_index[seqs][batch.q_valid[seqs]]  # each query's row, in order
