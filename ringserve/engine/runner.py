"""Runs one rank's slice of the model for a decision (the only engine file
that touches tensors)."""

from __future__ import annotations

import contextlib

import msgspec
import torch

from ringserve.cache.host_pool import HostPool
from ringserve.cache.pool import KVPool
from ringserve.engine.prompt_logprobs import prompt_logprobs
from ringserve.engine.replica import Row
from ringserve.engine.sampler import Sampler
from ringserve.engine.verify import Verification, Verifier
from ringserve.kernels import ops
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.cpu_native import CpuKernels
from ringserve.models.decode_graphs import DecodeGraphs
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
        host: HostPool | None = None,
        native: CpuKernels | None = None,
        gather_limit: int | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs  # decode passes replayed as CUDA graphs, where the rank has them
        self.native = native
        self.gather_limit = gather_limit  # see ForwardBatch.gather_limit
        self.pool = pool
        self.host = host
        self.device = device
        self.layers = layers
        self.first = layers.start == 0
        self.last = layers.stop == num_layers
        self.sampler = Sampler()
        self.verifier = Verifier(self.sampler)

    def batch(self, decision: Decision, rows: list[Row]) -> ForwardBatch:
        entries = decision.entries
        sizes = [len(e.tokens) for e in entries]
        slots = [r.slots.array() for r in rows]
        if self.graphs is not None and self.graphs.takes(sizes, [len(s) for s in slots]):
            return self.graphs.batch(slots, [e.sample for e in entries])
        return ForwardBatch.build(
            slots,
            sizes,
            [e.sample for e in entries],
            self.device,
            self.native,
            self.gather_limit,
        )

    @torch.inference_mode()
    def move_kv(self, decision: Decision) -> None:
        """The pass's copies between the tiers, spills first (see Decision)."""
        if not decision.spills and not decision.loads:
            return
        if self.host is None:
            raise ValueError("this rank has no host KV tier, but the pass moves KV to it")
        self.host.spill(self.pool, decision.spills)
        self.host.load(self.pool, decision.loads)

    @torch.inference_mode()
    def forward(
        self, decision: Decision, batch: ForwardBatch, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Hidden states after this rank's layers. `hidden` is the upstream
        rank's output, or None on the first stage."""
        if self.graphs is not None and self.graphs.owns(batch):
            ids = [e.tokens[0] for e in decision.entries] if self.first else None
            return self.graphs.forward(ids, hidden)
        if self.first:
            ids = [t for e in decision.entries for t in e.tokens]
            x = torch.tensor(ids, dtype=torch.int64, device=self.device)
        elif hidden is None:
            raise ValueError("a downstream stage needs the upstream hidden states")
        else:
            x = hidden.to(self.device)
        return self.model(x, batch, self.pool)

    def on_device(self) -> contextlib.AbstractContextManager:
        """This rank's GPU as the calling thread's current device (`ops.device_scope`)."""
        return ops.device_scope(self.device)

    @staticmethod
    def to_wire(hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states as the ring carries them: in host memory, since
        gloo sends CPU tensors only. Off a GPU the copy is made here, in the
        forward thread, which waits for it, so the link never reads a
        tensor the device is still writing (on the CPU, `to` is the tensor
        itself)."""
        return hidden.to("cpu")

    @torch.inference_mode()
    def dry_run(self, tokens: int, rows: int) -> None:
        """One forward of the largest pass the server runs (`tokens` new
        tokens in `rows` sequences, logits of every row on the last stage),
        writing only into free pool slots: used to measure the activation
        peak at boot, before any request exists."""
        rows_slots = dry_run_slots(tokens, rows, self.pool.capacity)
        tokens, sizes = sum(map(len, rows_slots)), [len(r) for r in rows_slots]
        batch = ForwardBatch.build(
            rows_slots, sizes, [True] * len(sizes), self.device, self.native, self.gather_limit
        )
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
        self,
        decision: Decision,
        rows: list[Row],
        batch: ForwardBatch,
        hidden: torch.Tensor,
        masks: torch.Tensor | None = None,
    ) -> Output:
        out = self._sample(decision, rows, batch, hidden, masks)
        prompt = prompt_logprobs(decision, rows, hidden, self.model.logits)
        return out if prompt is None else msgspec.structs.replace(out, prompt_logprobs=prompt)

    def _sample(
        self,
        decision: Decision,
        rows: list[Row],
        batch: ForwardBatch,
        hidden: torch.Tensor,
        masks: torch.Tensor | None,
    ) -> Output:
        if any(e.draft for e in decision.entries):
            return self._verify(decision, rows, hidden, masks)
        logits = self.model.logits(hidden[batch.sample_rows])
        picked = [(e, r) for e, r in zip(decision.entries, rows, strict=True) if e.sample]
        specs = [r.sampling for _, r in picked]
        positions = [e.start + len(e.tokens) for e, _ in picked]
        histories = [r.tokens for _, r in picked]
        rows_masks = None
        if masks is not None:  # one row per masked entry, in entry order
            masked = [i for i, (e, _) in enumerate(picked) if e.masked]
            rows_masks = (torch.tensor(masked, dtype=torch.int64), masks)
        return self.sampler(decision.pass_id, logits, specs, positions, histories, rows_masks)

    def _verify(
        self, decision: Decision, rows: list[Row], hidden: torch.Tensor, masks: torch.Tensor | None
    ) -> Output:
        """A pass with verification rows: logits at every speculative
        position (and the last of every other sampled entry, under its mask
        when it is masked: a masked entry proposes nothing, so it is one
        logits row)."""
        picked, checks, end, masked = [], [], 0, []
        for e, r in zip(decision.entries, rows, strict=True):
            end += len(e.tokens)
            if e.sample:
                if e.masked:
                    masked.append(len(picked))
                picked += range(end - e.draft - 1, end)
                position = e.start + len(e.tokens) - e.draft
                history = None if r.tokens is None else r.tokens[: len(r.tokens) - e.draft]
                proposals = e.tokens[len(e.tokens) - e.draft :]
                checks.append(Verification(r.sampling, position, proposals, history))
        idx = torch.tensor(picked, dtype=torch.int64, device=hidden.device)
        rows_masks = None
        if masks is not None:
            rows_masks = (torch.tensor(masked, dtype=torch.int64), masks)
        return self.verifier(decision.pass_id, self.model.logits(hidden[idx]), checks, rows_masks)


def dry_run_slots(tokens: int, rows: int, capacity: int) -> list[list[int]]:
    """The slots of a dry forward's `rows` rows sharing `tokens` tokens, all
    among the pool's usable slots 1..capacity-1: a pool smaller than the
    largest pass clamps the pass (rows included) rather than writing past
    its end."""
    usable = capacity - 1
    if usable < 1:
        raise ValueError(f"a KV pool of {capacity} slots has none usable")
    rows = max(1, min(rows, usable))
    tokens = max(rows, min(tokens, usable))
    sizes = [tokens // rows + (1 if r < tokens % rows else 0) for r in range(rows)]
    slots = iter(range(1, tokens + 1))
    return [[next(slots) for _ in range(n)] for n in sizes]
