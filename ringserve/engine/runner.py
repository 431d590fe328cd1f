"""Runs one rank's slice of the model for a decision (the only engine file
that touches tensors)."""

from __future__ import annotations

import torch

from ringserve.cache.pool import KVPool
from ringserve.engine.replica import Row
from ringserve.engine.sampler import Sampler
from ringserve.engine.verify import Verification, Verifier
from ringserve.kernels.batch import ForwardBatch
from ringserve.ring.messages import Decision, Output


class Runner:
    """Owns the rank's model slice and KV pool. `first` stages embed token
    ids; `last` stages sample."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        device: torch.device,
        layers: range,
        num_layers: int,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.layers = layers
        self.first = layers.start == 0
        self.last = layers.stop == num_layers
        self.sampler = Sampler()
        self.verifier = Verifier(self.sampler)

    def batch(self, decision: Decision, rows: list[Row]) -> ForwardBatch:
        entries = decision.entries
        return ForwardBatch.build(
            [r.slots for r in rows],
            [len(e.tokens) for e in entries],
            [e.sample for e in entries],
            self.device,
        )

    @torch.inference_mode()
    def forward(
        self, decision: Decision, batch: ForwardBatch, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Hidden states after this rank's layers. `hidden` is the upstream
        rank's output, or None on the first stage."""
        if self.first:
            ids = [t for e in decision.entries for t in e.tokens]
            x = torch.tensor(ids, dtype=torch.int64, device=self.device)
        elif hidden is None:
            raise ValueError("a downstream stage needs the upstream hidden states")
        else:
            x = hidden.to(self.device)
        return self.model(x, batch, self.pool)

    @torch.inference_mode()
    def dry_run(self, tokens: int, rows: int) -> None:
        """One forward of the largest pass the server runs (`tokens` new
        tokens in `rows` sequences, logits of every row on the last stage),
        writing only into free pool slots: used to measure the activation
        peak at boot, before any request exists."""
        tokens = max(rows, min(tokens, self.pool.capacity - 1))
        sizes = [tokens // rows + (1 if r < tokens % rows else 0) for r in range(rows)]
        slots, rows_slots = iter(range(1, tokens + 1)), []
        for n in sizes:
            rows_slots.append([next(slots) for _ in range(n)])
        batch = ForwardBatch.build(rows_slots, sizes, [True] * rows, self.device)
        if self.first:
            x = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        else:
            x = torch.zeros(tokens, self.model.cfg.hidden_size, device=self.device)
            x = x.to(next(self.model.parameters()).dtype)
        hidden = self.model(x, batch, self.pool)
        if self.last:
            self.model.logits(hidden[batch.sample_rows])

    @torch.inference_mode()
    def sample(
        self, decision: Decision, rows: list[Row], batch: ForwardBatch, hidden: torch.Tensor
    ) -> Output:
        if any(e.draft for e in decision.entries):
            return self._verify(decision, rows, hidden)
        logits = self.model.logits(hidden[batch.sample_rows])
        picked = [(e, r) for e, r in zip(decision.entries, rows, strict=True) if e.sample]
        specs = [r.sampling for _, r in picked]
        positions = [e.start + len(e.tokens) for e, _ in picked]
        return self.sampler(decision.pass_id, logits, specs, positions)

    def _verify(self, decision: Decision, rows: list[Row], hidden: torch.Tensor) -> Output:
        """A pass with verification rows: logits at every speculative
        position (and the last of every other sampled entry)."""
        picked, checks, end = [], [], 0
        for e, r in zip(decision.entries, rows, strict=True):
            end += len(e.tokens)
            if e.sample:
                picked += range(end - e.draft - 1, end)
                position = e.start + len(e.tokens) - e.draft
                checks.append(
                    Verification(r.sampling, position, e.tokens[len(e.tokens) - e.draft :])
                )
        idx = torch.tensor(picked, dtype=torch.int64, device=hidden.device)
        return self.verifier(decision.pass_id, self.model.logits(hidden[idx]), checks)
