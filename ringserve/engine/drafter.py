"""Rank 0's draft model (`--speculative draft`): a small model of the
target's vocabulary that proposes each decoding request's next k tokens,
greedily, over its own KV pool and slot allocator. It holds all of its
layers on rank 0 and is read by no other rank: its proposals reach the ring
only inside decisions, as the n-gram proposer's do.

Per request the drafter keeps a row of its own slots for a prefix of the
request's history, which only grows; a proposal first extends that row to
the whole history (the tokens accepted since the last proposal, the
newest included), then draws k - 1 more steps, and cuts the row back to the
history, freeing the slots of its own guesses. A row far behind its history
(a request's first proposal, after its whole prompt) catches up in chunks,
so no draft forward runs more than `max_tokens` tokens, the largest pass the
memory plan holds the draft's activations for; and a request never has the
draft write past the draft model's own positions (`max_positions`): one
whose proposals would gets fewer, or none.
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
        *,
        max_tokens: int,
        max_positions: int,
    ) -> None:
        if max_tokens < 1 or max_positions < 1:
            raise ValueError(
                f"max_tokens {max_tokens} and max_positions {max_positions} must be >= 1"
            )
        self.model = model
        self.max_tokens = max_tokens  # the most tokens one draft forward runs
        self.max_positions = max_positions  # the draft model's positions
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
        for req_id, history, asked in asks:
            # the k-th proposal is drawn at position len(history) + k - 2
            k = min(asked, self.max_positions - len(history) + 1)
            if k < 1:
                continue
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
        self._catch_up([(r, h[:-1], start) for r, h, _, start in taken])
        feeds = [h[-1:] for _, h, _, _ in taken]
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

    def _catch_up(self, behind: list[tuple[int, list[int], int]]) -> None:
        """Write the draft's KV of each (req_id, tokens, start)'s
        tokens[start:] into its row, in forwards of at most `max_tokens`
        tokens, no logits drawn."""
        done = {r: start for r, _, start in behind}
        left = [(r, t) for r, t, start in behind if len(t) > start]
        while left:
            rows, feeds, budget = [], [], self.max_tokens
            for r, tokens in left:
                if budget == 0:
                    break
                n = min(len(tokens) - done[r], budget)
                rows.append(self.rows[r][: done[r] + n])
                feeds.append(tokens[done[r] : done[r] + n])
                done[r] += n
                budget -= n
            self._forward(rows, feeds, sample=False)
            left = [(r, t) for r, t in left if done[r] < len(t)]

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
        return self._forward(rows, feeds, sample=True)

    def _forward(self, rows: list[list[int]], feeds: list[list[int]], sample: bool) -> list[int]:
        batch = ForwardBatch.build(
            rows,
            [len(f) for f in feeds],
            [sample] * len(rows),
            self.device,
            self.native,
            self.gather_limit,
        )
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, batch, self.pool)
        if not sample:
            return []
        logits = self.model.logits(hidden[batch.sample_rows]).float()
        return torch.nan_to_num(logits, nan=float("-inf")).argmax(-1).tolist()
