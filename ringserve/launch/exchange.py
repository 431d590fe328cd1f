"""A ring of several nodes is sized once, by node 0 (DESIGN §1): node 0's
launcher publishes its sized config on a TCP store at the master port + 1,
and every other node's launcher takes the ring's terms from there
(`EngineConfig.with_ring_of`) instead of sizing a ring of its own. When node
0 plans without given budgets or split, it asks, and each other node offers
its own ranks' budgets as measured on its own devices. A node keeps its own
per-rank choices (device, kernels, threads). The ranks still check at their
rendezvous that they agree (`ring/group.py`): what cannot be taken, the
model's own config, must match. msgspec JSON on the wire, no pickle."""

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
ASK_KEY = "ringserve/budgets-asked"  # whether node 0 plans from them


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

    def ask_budgets(self, asked: bool) -> None:
        """Node 0 says whether it plans from measured budgets: only then do
        the other nodes measure (on a GPU, measuring opens a CUDA context in
        the launcher that holds memory while it runs)."""
        self.store.set(ASK_KEY, b"1" if asked else b"0")

    def budgets_asked(self) -> bool:
        return self._get(ASK_KEY, "say whether it plans from measured budgets") == b"1"

    def offer_budgets(self, budgets: list[int]) -> None:
        """This node's ranks' budgets as measured here, for node 0's plan."""
        self.store.set(f"{BUDGETS_KEY}/{self.node_rank}", msgspec.json.encode(budgets))

    def gather_budgets(self, own: list[int], nnodes: int) -> list[int]:
        """Every rank's budget, node by node in rank order: node 0's `own`,
        then each other node's as it measured them."""
        budgets = list(own)
        for node in range(1, nnodes):
            raw = self._get(f"{BUDGETS_KEY}/{node}", f"receive node {node}'s budgets")
            budgets += msgspec.json.decode(raw, type=list[int])
        return budgets

    def publish(self, sized: EngineConfig) -> None:
        self.store.set(RING_KEY, encode_config(sized))
        log.info("ring.published", node=self.node_rank, layer_split=sized.layer_split)

    def take(self, own: EngineConfig) -> EngineConfig:
        """`own` on the ring node 0 sized."""
        sized = decode_config(self._get(RING_KEY, "publish the ring").decode())
        return own.with_ring_of(sized)

    def _get(self, key: str, what: str) -> bytes:
        """The value at `key`, waiting for it up to the timeout."""
        try:
            return self.store.get(key)
        except (RuntimeError, TimeoutError) as exc:
            raise UserError(
                f"the ring exchange did not {what} within {self.timeout_s:.0f} s ({exc})"
            ) from None
