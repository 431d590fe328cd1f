"""Rank 0's draft model (`--speculative draft`): a small model of the
target's vocabulary that proposes each decoding request's next k tokens,
greedily, over its own KV pool and slot allocator. It holds all of its
layers on rank 0 and is read by no other rank: its proposals reach the ring
only inside decisions, as the n-gram proposer's do.

Per request the drafter keeps a row of its own slots for a prefix of the
request's history, which only grows; a proposal first extends that row to
the whole history (the tokens accepted since the last proposal, the
newest included), then draws k - 1 more steps, and cuts the row back to the
history, freeing the slots of its own guesses.
"""

from __future__ import annotations

import torch

from ringserve.cache.allocator import OutOfSlots, SlotAllocator
from ringserve.cache.pool import KVPool
from ringserve.engine.runner import dry_run_slots
from ringserve.kernels import ops
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.cpu_native import CpuKernels


class Drafter:
    """Invariant: `rows[r]` holds the slots of request r's tokens[:len(rows[r])]
    in the draft pool, each slot taken from `allocator` and held by one row."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        device: torch.device,
        native: CpuKernels | None = None,
        gather_limit: int | None = None,
    ) -> None:
        self.model = model
        self.native = native
        self.gather_limit = gather_limit  # see ForwardBatch.gather_limit
        self.pool = pool
        self.device = device
        self.allocator = SlotAllocator(pool.capacity)
        self.rows: dict[int, list[int]] = {}

    def release(self, live: set[int]) -> None:
        """Free the rows of requests no longer live."""
        for req_id in [r for r in self.rows if r not in live]:
            self.allocator.free(self.rows.pop(req_id))

    def propose(self, asks: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        """For each (req_id, history, k >= 1): k tokens the draft model
        writes after the history. A request the pool cannot hold gets none."""
        with ops.device_scope(self.device):
            return self._propose(asks)

    @torch.inference_mode()
    def _propose(self, asks: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        taken: list[tuple[int, list[int], int, int]] = []  # req_id, history, k, start
        for req_id, history, k in asks:
            row = self.rows.setdefault(req_id, [])
            if len(row) >= len(history):  # asked again for one history: redo its last token
                self.allocator.free(row[len(history) - 1 :])
                del row[len(history) - 1 :]
            start = len(row)
            try:
                row += self.allocator.alloc(len(history) - start + k - 1)
            except OutOfSlots:
                self.allocator.free(self.rows.pop(req_id))
                continue
            taken.append((req_id, history, k, start))
        if not taken:
            return {}
        drafts: dict[int, list[int]] = {r: [] for r, _, _, _ in taken}
        feeds = [h[start:] for _, h, _, start in taken]
        for step in range(max(k for _, _, k, _ in taken)):
            live = [t for t in taken if t[2] > step]
            if step > 0:
                feeds = [[drafts[r][-1]] for r, _, _, _ in live]
            lens = [len(h) + step for _, h, _, _ in live]
            rows = [self.rows[r][:n] for (r, _, _, _), n in zip(live, lens, strict=True)]
            tokens = self._step(rows, feeds)
            for (r, _, _, _), t in zip(live, tokens, strict=True):
                drafts[r].append(t)
        for req_id, history, _, _ in taken:
            row = self.rows[req_id]
            self.allocator.free(row[len(history) :])
            del row[len(history) :]
        return drafts

    @torch.inference_mode()
    def dry_run(self, tokens: int, rows: int) -> None:
        """One draft forward of `tokens` tokens in `rows` rows, logits of
        every row, writing only into free pool slots: the boot audit
        measures the draft's activation peak with it, before any request."""
        rows_slots = dry_run_slots(tokens, rows, self.pool.capacity)
        sizes = [len(r) for r in rows_slots]
        batch = ForwardBatch.build(
            rows_slots, sizes, [True] * len(sizes), self.device, self.native, self.gather_limit
        )
        ids = torch.zeros(sum(sizes), dtype=torch.int64, device=self.device)
        self.model.logits(self.model(ids, batch, self.pool)[batch.sample_rows])

    def _step(self, rows: list[list[int]], feeds: list[list[int]]) -> list[int]:
        """One forward: each row extends by its feed; the argmax after each."""
        batch = ForwardBatch.build(
            rows,
            [len(f) for f in feeds],
            [True] * len(rows),
            self.device,
            self.native,
            self.gather_limit,
        )
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, batch, self.pool)
        logits = self.model.logits(hidden[batch.sample_rows]).float()
        return torch.nan_to_num(logits, nan=float("-inf")).argmax(-1).tolist()
