"""A ring of several nodes is sized once, by node 0 (DESIGN §1): node 0's
launcher publishes its sized config on a TCP store at the master port + 1,
and every other node's launcher takes the ring's terms from there
(`EngineConfig.with_ring_of`) instead of sizing a ring of its own. When node
0 plans without given budgets or split, it asks, and each other node offers
its own ranks' budgets as measured on its own devices. A node keeps its own
per-rank choices (device, kernels, threads). Each other node then says
whether it joins (a node started for another ring, more ranks or nodes,
refuses, and node 0 says so too), and node 0 starts its ranks only once
every node has joined, so a node that never comes is named by the
launchers, not by a rank timing out. The ranks still check at their
rendezvous that they agree (`ring/group.py`): what cannot be taken, the
model's own config, must match. msgspec JSON on the wire, no pickle.

Every wait here polls, so Ctrl-C ends it at once (a blocking store call
would hold the signal until its timeout), and says once what it waits for."""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable

import msgspec
import structlog
import torch.distributed as dist

from ringserve.config import EngineConfig, UserError
from ringserve.launch.processes import decode_config, encode_config
from ringserve.logs import say

log = structlog.get_logger(__name__)

RING_KEY = "ringserve/ring"
SHAPE_KEY = "ringserve/shape"  # [ranks, nodes] of node 0's ring
JOINED_KEY = "ringserve/joined"  # per node: empty when it joins, else why it refuses
BUDGETS_KEY = "ringserve/budgets"  # each node's measured budgets, for node 0's plan
ASK_KEY = "ringserve/budgets-asked"  # whether node 0 plans from them
CLAIM_KEY = "ringserve/node"  # per node rank: how many nodes came as it (one may)
POLL_S = 0.1
QUIET_S = 2.0  # a wait longer than this says what it waits for


class RingExchange:
    """Invariant: node 0 publishes exactly once, before any of its ranks
    starts; the store lives as long as node 0's launcher."""

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int,
                 ranks: int, timeout_s: float = 300.0) -> None:  # fmt: skip
        self.node_rank = node_rank
        self.timeout_s = timeout_s
        self.where = f"{master_addr}:{master_port + 1}"
        if node_rank != 0:
            self._wait_until_served(master_addr, master_port + 1)
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
        shape = msgspec.json.encode([ranks, nnodes])
        if node_rank == 0:
            self.store.set(SHAPE_KEY, shape)
        elif (theirs := self._get(SHAPE_KEY, "say its ring's shape")) != shape:
            ranks0, nnodes0 = msgspec.json.decode(theirs, type=list[int])
            why = (
                f"node {node_rank} was started with --pp {ranks} --nnodes {nnodes}, "
                f"node 0 with --pp {ranks0} --nnodes {nnodes0}"
            )
            self.store.set(f"{JOINED_KEY}/{node_rank}", why.encode())
            raise UserError(f"{why}: start every node with the same ring")
        if node_rank != 0 and self.store.add(f"{CLAIM_KEY}/{node_rank}", 1) > 1:
            raise UserError(
                f"node rank {node_rank} has already joined node 0's ring exchange at {self.where}: "
                "give each node its own --node-rank (a node started again joins a node 0 "
                "started again)"
            )

    def answers(self) -> bool:
        """Whether node 0's exchange listens, as it does while node 0's
        launcher runs (a connection opened and closed, no store request)."""
        host, _, port = self.where.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            return False

    def _wait_until_served(self, host: str, port: int) -> None:
        """Wait for node 0's exchange to listen (torch's own connect retries
        in C++, deaf to Ctrl-C, and prints a stack at each retry)."""
        if not self._poll(self.answers, f"node 0's ring exchange at {self.where}"):
            raise UserError(
                f"node 0's ring exchange at {self.where} did not answer within "
                f"{self.timeout_s:.0f} s: is node 0 started, with this --master-addr and "
                "--master-port?"
            )

    def _poll(self, ready: Callable[[], bool], awaited: str) -> bool:
        """Whether `ready()` came true within the timeout, asked every
        POLL_S (sleeps Ctrl-C ends); says once what it waits for."""
        began, said = time.monotonic(), False
        while not ready():
            waited = time.monotonic() - began
            if waited > self.timeout_s:
                return False
            if not said and waited > QUIET_S:
                say(f"waiting for {awaited}")
                said = True
            time.sleep(POLL_S)
        return True

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
            raw = self._get(f"{BUDGETS_KEY}/{node}", f"receive node {node}'s budgets", node)
            budgets += msgspec.json.decode(raw, type=list[int])
        return budgets

    def publish(self, sized: EngineConfig) -> None:
        self.store.set(RING_KEY, encode_config(sized))
        log.info("ring.published", node=self.node_rank, layer_split=sized.layer_split)

    def take(self, own: EngineConfig) -> EngineConfig:
        """`own` on the ring node 0 sized; node 0 hears that this node joins."""
        sized = decode_config(self._get(RING_KEY, "publish the ring").decode())
        self.store.set(f"{JOINED_KEY}/{self.node_rank}", b"")
        return own.with_ring_of(sized)

    def wait_for_nodes(self, nnodes: int) -> None:
        """Node 0: return once every other node has joined; UserError naming
        a node that refused, or that never came within the timeout."""
        for node in range(1, nnodes):
            self._get(f"{JOINED_KEY}/{node}", f"hear from node {node}", node)

    def _get(self, key: str, what: str, node: int | None = None) -> bytes:
        """The value at `key`, waiting for it up to the timeout; UserError
        once `node` (when given) has refused the ring instead."""
        refusal = f"{JOINED_KEY}/{node}"

        def ready() -> bool:
            if node is not None and self.store.check([refusal]):
                why = self.store.get(refusal)
                if why:
                    raise UserError(f"node {node} refused the ring: {why.decode()}")
            return self.store.check([key])

        try:
            if not self._poll(ready, f"the ring exchange ({self.where}) to {what}"):
                raise TimeoutError(f"no {key} after {self.timeout_s:.0f} s")
            return self.store.get(key)
        except (RuntimeError, TimeoutError) as exc:
            raise UserError(
                f"the ring exchange did not {what} within {self.timeout_s:.0f} s ({exc})"
            ) from None
