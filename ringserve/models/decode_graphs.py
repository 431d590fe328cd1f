"""CUDA graphs of decode passes: a GPU decode pass is short, and launching
its kernels one by one from Python costs several times the GPU's own time
(measured on an H200: 77 launches and 3.1 ms of wall time for 0.5 ms of GPU
work, four layers at 1B shapes). A pass whose every sequence decodes one
token replays a graph captured once per bucket of (rows, context width)
instead: one launch for the whole slice.

A graph reads its inputs from static buffers. Per pass the rows' positions,
output slots, context lengths, context slots and (on the first stage) token
ids are written into one pinned host buffer and moved in one copy; rows past
the pass's up to the bucket's are padding: one token at position 0 whose K/V
goes to slot 0, the pool's reserved padding slot, attending to slot 0 alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import structlog
import torch

from ringserve.cache.pool import KVPool
from ringserve.kernels.batch import ForwardBatch

log = structlog.get_logger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WIDTH = 256  # context widths are bucketed by powers of two from here


def row_bucket(rows: int, max_rows: int) -> int | None:
    """The smallest captured row count that holds `rows`, or None past `max_rows`."""
    if rows > max_rows:
        return None
    return min(next((b for b in ROW_BUCKETS if b >= rows), max_rows), max_rows)


def width_bucket(width: int, max_width: int) -> int | None:
    """The smallest captured context width (a power of two from MIN_WIDTH,
    or `max_width` itself) that holds `width`, or None past `max_width`."""
    if width > max_width:
        return None
    bucket = MIN_WIDTH
    while bucket < width:
        bucket *= 2
    return min(bucket, max_width)


class DecodeGraphs:
    """Invariant: a graph replays only after `batch` has written its pass
    into the static buffers, and the hidden states it returns are a view of
    the graph's output, valid until the next replay (the stage consumes them
    before its next pass: it samples them or copies them to the wire)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        device: torch.device,
        *,
        first: bool,
        max_rows: int,
    ) -> None:
        self.model, self.pool, self.device, self.first = model, pool, device, first
        # off a GPU the same static buffers run op by op (no graph to capture)
        self.captures = device.type == "cuda"
        self.max_rows = max(1, min(max_rows, ROW_BUCKETS[-1]))
        self.max_width = pool.capacity
        rows = self.max_rows
        dtype = next(model.parameters()).dtype
        self._hidden = torch.zeros(rows, model.cfg.hidden_size, dtype=dtype, device=device)
        self._ones = torch.ones(rows, dtype=torch.int64, device=device)
        self._arange = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self._true = torch.ones(rows, 1, dtype=torch.bool, device=device)
        self._width = 0  # the widest context the index buffers hold (`_reserve`)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._eager: set[tuple[int, int]] = set()  # buckets whose capture failed
        self._mempool = torch.cuda.graph_pool_handle() if self.captures else None
        self._current: tuple[ForwardBatch, int, int] | None = None
        self.replays = 0  # for tests and figures

    def takes(self, sizes: list[int], widths: list[int]) -> bool:
        """Whether a pass of these new-token counts and context lengths replays a graph."""
        return (
            bool(sizes)
            and all(n == 1 for n in sizes)
            and row_bucket(len(sizes), self.max_rows) is not None
            and width_bucket(max(widths), self.max_width) is not None
        )

    def batch(self, slots: Sequence[Sequence[int]], sample: list[bool]) -> ForwardBatch:
        """Write the pass (each row's context slots, its new token last) into
        the static buffers, one copy to the device, and return the pass's
        batch, whose tensors are views of them."""
        n = len(slots)
        rows = row_bucket(n, self.max_rows)
        width = width_bucket(max(map(len, slots)), self.max_width)
        self._reserve(width)
        host, r = self._host_np, self.max_rows
        lens = np.fromiter(map(len, slots), dtype=np.int64, count=n)
        host[0:n] = lens - 1  # positions
        host[r : r + n] = [s[-1] for s in slots]  # out_slots
        host[2 * r : 2 * r + n] = lens  # seq_lens
        host[[*range(n, rows), *range(r + n, r + rows)]] = 0  # padding rows: position 0, slot 0
        host[2 * r + n : 2 * r + rows] = 1
        ctx = host[4 * r : 4 * r + rows * width].reshape(rows, width)
        for b, row in enumerate(slots):
            ctx[b, : len(row)] = row
        ctx[n:rows, 0] = 0
        used = 4 * r + rows * width
        self._dev[:used].copy_(self._host[:used], non_blocking=True)
        picked = [b for b, s in enumerate(sample) if s]
        batch = self._views(rows, width, n, self._sample_rows(picked, n))
        self._current = (batch, rows, width)
        return batch

    def _reserve(self, width: int) -> None:
        """Index buffers for contexts up to `width` tokens (a bucket): grown
        when a wider pass first comes, not sized for the whole pool up front
        (64 rows of a million-slot pool would be 512 MiB twice). Growing
        drops every graph, which read the old buffers."""
        if width <= self._width:
            return
        r = self.max_rows
        # positions | out_slots | seq_lens | token ids | context slots [rows, width]
        size = 4 * r + r * width
        pinned = self.device.type == "cuda"  # so the one copy to the GPU can run ahead
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._arange_width = torch.arange(width, dtype=torch.int64, device=self.device)
        if self._graphs:
            log.debug("decode_graph.regrown", width=width, dropped=len(self._graphs))
        self._graphs.clear()
        self._width = width

    def _views(self, rows: int, width: int, n: int, sample_rows: torch.Tensor) -> ForwardBatch:
        """The first `n` of a bucket's `rows` as a batch over the static
        buffers, its attention mask made from the rows' context lengths."""
        dev, r = self._dev, self.max_rows
        seq_lens = dev[2 * r : 2 * r + n]
        mask = self._arange_width[:width][None, :] < seq_lens[:, None]
        return ForwardBatch(
            positions=dev[0:n],
            out_slots=dev[r : r + n],
            req_slots=dev[4 * r : 4 * r + rows * width].view(rows, width)[:n],
            seq_lens=seq_lens,
            extend_lens=self._ones[:n],
            qo_indptr=self._arange[: n + 1],
            q_index=self._arange[:n, None],
            q_valid=self._true[:n],
            valid_rows=self._arange[:n],
            attn_mask=mask[:, None, None, :],
            sample_rows=sample_rows,
            max_extend=1,
            num_tokens=n,
        )

    def _sample_rows(self, picked: list[int], n: int) -> torch.Tensor:
        if len(picked) == n:  # a decode pass samples every row, as a rule
            return self._arange[:n]
        return torch.tensor(picked, dtype=torch.int64).to(self.device)

    def owns(self, batch: ForwardBatch) -> bool:
        return self._current is not None and self._current[0] is batch

    def forward(self, ids: list[int] | None, hidden: torch.Tensor | None) -> torch.Tensor:
        """Replay the graph of the batch last written (capturing it on its
        first use): the hidden states of its rows."""
        if self._current is None:
            raise RuntimeError("a decode graph replays only after its batch was written")
        batch, rows, width = self._current
        n, r = batch.num_tokens, self.max_rows
        if self.first:
            if ids is None:
                raise ValueError("the first stage's decode graph needs the token ids")
            self._host_np[3 * r : 3 * r + n] = ids
            self._host_np[3 * r + n : 3 * r + rows] = 0
            self._dev[3 * r : 3 * r + rows].copy_(self._host[3 * r : 3 * r + rows], True)
        elif hidden is None:
            raise ValueError("a downstream stage needs the upstream hidden states")
        else:
            self._hidden[:n].copy_(hidden)
        self._current = None
        graph = self._graph(rows, width)
        if graph is None:
            return self._step(rows, width)[:n]
        graph[0].replay()
        self.replays += 1
        return graph[1][:n]

    def _graph(self, rows: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The bucket's graph, captured on its first use; None where passes
        run op by op: off a GPU, or in a bucket whose capture failed (out of
        memory, say), which is logged once and not tried again."""
        key = (rows, width)
        if not self.captures or key in self._eager:
            return None
        if key not in self._graphs:
            try:
                self._capture(rows, width)
            except RuntimeError as exc:
                log.warning("decode_graph.capture_failed", rows=rows, width=width, error=str(exc))
                self._eager.add(key)
                return None
        return self._graphs[key]

    def _step(self, rows: int, width: int) -> torch.Tensor:
        """The slice's forward over the static buffers at this bucket: what
        a graph captures (the attention mask is computed here, inside it, from
        the rows' context lengths)."""
        batch = self._views(rows, width, rows, self._arange[:rows])
        dev, r = self._dev, self.max_rows
        x = dev[3 * r : 3 * r + rows] if self.first else self._hidden[:rows]
        return self.model(x, batch, self.pool)

    @torch.inference_mode()
    def _capture(self, rows: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the slice's forward at this bucket; a warm-up run first
        (Triton compiles, cuBLAS picks its kernels) on a side stream, as
        capture needs. The static inputs hold a valid pass meanwhile: the
        current one."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(rows, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            out = self._step(rows, width)
        self._graphs[(rows, width)] = (graph, out)
        log.debug("decode_graph.captured", rows=rows, width=width, graphs=len(self._graphs))
        return graph, out
