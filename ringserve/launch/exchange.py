"""A ring of several nodes is sized once, by node 0 (DESIGN §1): node 0's
launcher publishes its sized config on a TCP store at the master port + 1,
and every other node's launcher takes the ring's terms from there
(`EngineConfig.with_ring_of`) instead of sizing a ring of its own from its
own measurements. A node keeps its own per-rank choices (device, kernels,
threads). The ranks still check at their rendezvous that they agree
(`ring/group.py`): what cannot be taken, the model's own config, must match.
msgspec JSON on the wire, no pickle."""

from __future__ import annotations

import datetime

import structlog
import torch.distributed as dist

from ringserve.config import EngineConfig, UserError
from ringserve.launch.processes import decode_config, encode_config

log = structlog.get_logger(__name__)

RING_KEY = "ringserve/ring"


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
