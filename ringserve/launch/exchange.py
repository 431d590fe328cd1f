"""A ring of several nodes is sized once, by node 0 (DESIGN §1): node 0's
launcher publishes its sized config on a TCP store at the master port + 1,
and every other node's launcher takes the ring's terms from there
(`EngineConfig.with_ring_of`) instead of sizing a ring of its own. Without
given budgets, each node first offers its own ranks' budgets as measured on
its own devices, and node 0 plans with them all. A node keeps its own per-rank choices (device, kernels,
threads). The ranks still check at their rendezvous that they agree
(`ring/group.py`): what cannot be taken, the model's own config, must match.
msgspec JSON on the wire, no pickle."""

from __future__ import annotations

import datetime

import msgspec
import structlog
import torch.distributed as dist

from ringserve.config import EngineConfig, UserError
from ringserve.launch.processes import decode_config, encode_config

log = structlog.get_logger(__name__)

RING_KEY = "ringserve/ring"
BUDGETS_KEY = "ringserve/budgets"  # each node's measured budgets, for node 0's plan


class RingExchange:
    """Invariant: node 0 publishes exactly once, before any of its ranks
    starts; the store lives as long as node 0's launcher."""

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int,
                 timeout_s: float = 300.0) -> None:  # fmt: skip
        self.node_rank = node_rank
        self.timeout_s = timeout_s
        try:
            self.store = dist.TCPStore(
                master_addr,
                master_port + 1,
                nnodes,
                is_master=node_rank == 0,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, TimeoutError) as exc:
            what = "serve" if node_rank == 0 else "reach node 0's"
            raise UserError(
                f"node {node_rank} cannot {what} ring exchange at {master_addr}:{master_port + 1} "
                f"({exc}); it uses the port after --master-port"
            ) from None

    def offer_budgets(self, budgets: list[int]) -> None:
        """This node's ranks' budgets as measured here, for node 0's plan."""
        self.store.set(f"{BUDGETS_KEY}/{self.node_rank}", msgspec.json.encode(budgets))

    def gather_budgets(self, own: list[int], nnodes: int) -> list[int]:
        """Every rank's budget, node by node in rank order: node 0's `own`,
        then each other node's as it measured them (waits for them up to
        the timeout)."""
        budgets = list(own)
        for node in range(1, nnodes):
            try:
                raw = self.store.get(f"{BUDGETS_KEY}/{node}")
            except (RuntimeError, TimeoutError) as exc:
                raise UserError(
                    f"node {node} did not offer its budgets within {self.timeout_s:.0f} s ({exc})"
                ) from None
            budgets += msgspec.json.decode(raw, type=list[int])
        return budgets

    def publish(self, sized: EngineConfig) -> None:
        self.store.set(RING_KEY, encode_config(sized))
        log.info("ring.published", node=self.node_rank, layer_split=sized.layer_split)

    def take(self, own: EngineConfig) -> EngineConfig:
        """`own` on the ring node 0 sized (waits for it up to the timeout)."""
        try:
            sized = decode_config(self.store.get(RING_KEY).decode())
        except (RuntimeError, TimeoutError) as exc:
            raise UserError(
                f"node 0 did not publish the ring within {self.timeout_s:.0f} s ({exc})"
            ) from None
        return own.with_ring_of(sized)
