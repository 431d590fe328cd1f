"""Rank 0's book of tiers: the prefix cache whose nodes know where their KV
lives, on the device, in host memory, or both (DESIGN §3.9, §4). Pure
Python over ints: it decides the moves; every rank copies its own layers'
K/V for them (`cache/host_pool.py`) when the pass that carries them runs.

A node is in one of these states:

    device       value            no host copy
    both         value + host     (a load, or a spill's source kept later)
    host         host only        (a spill)
    in transit   `pending`: a spill (host only) or a load (both, locked)
                 decided for a pass whose terminal has not come back

Invariants: (1) the device-resident nodes hold the root's side of the tree:
a node on the device has its parent on the device, so device eviction takes
leaves of that part and a host node has only host nodes below it; (2) a
locked node is on the device; (3) a node in transit is never matched,
loaded, evicted from the host or inserted through: its copy's target is not
trusted until the terminal of the pass carrying it confirms it, and a void
rolls it back (a load's node returns to the host; a spill's node is dropped,
since its device slots were freed and may already hold other tokens);
(4) `host_evictable` counts exactly what `evict_host(math.inf)` pays (a
node on both tiers that leaves the device may keep children in transit,
so "unlocked and not in transit" is not enough: see `host_pinned`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import structlog

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.radix import Move, RadixCache, RadixNode, TierMatch, _common_length

log = structlog.get_logger(__name__)


class TieredCache(RadixCache):
    """The radix cache over two tiers: `allocator` for the device slots,
    `host` for the host slots (slot 0 of each is padding). Device eviction
    spills to the host before it drops anything; a match may end in host
    nodes that `load` brings back into fresh device slots. Receipts are
    plain counters: tokens spilled and loaded by passes that came back,
    prefix tokens admissions found in the host tier (loaded for them),
    host tokens evicted, tokens of moves rolled back by voids."""

    def __init__(self, allocator: SlotAllocator, host: SlotAllocator) -> None:
        super().__init__(allocator)
        self.host = host
        self._spills: list[Move] = []  # decided, not yet carried by a pass
        self._loads: list[Move] = []
        self._sealed: dict[int, tuple[list[Move], list[Move]]] = {}
        self.spilled_tokens = 0
        self.loaded_tokens = 0
        self.host_hit_tokens = 0
        self.host_evicted_tokens = 0
        self.rolled_back_tokens = 0

    # ---- figures ---------------------------------------------------------------

    @property
    def host_capacity(self) -> int:
        return self.host.capacity - 1

    @property
    def host_evictable(self) -> int:
        """Host slots that `evict_host(math.inf)` would free now."""
        return self._host_split()[0]

    @property
    def host_pinned(self) -> int:
        """Host slots it would not: a locked node's, a node's in transit, and
        a host-only node's above one of those (a node on both tiers, once it
        leaves the device, may have children whose spill is in flight)."""
        return self._host_split()[1]

    def _host_split(self) -> tuple[int, int]:
        stays: set[int] = set()  # nodes host eviction cannot take out of the tree
        evictable = pinned = 0
        for n in reversed(list(self._nodes())):  # children before parents
            blocked = any(id(c) in stays for c in n.children.values())
            if n.value or blocked or not self._host_free_to_go(n):
                stays.add(id(n))
            freeable = self._host_free_to_go(n) and (bool(n.value) or not blocked)
            evictable += len(n.host) if freeable else 0
            pinned += 0 if freeable else len(n.host)
        return evictable, pinned

    # ---- matching and loading --------------------------------------------------

    def match_tiers(self, tokens: Sequence[int]) -> TierMatch:
        """The device prefix, then the host nodes that continue it."""
        tokens = list(tokens)
        node, slots = self._match(tokens)
        pos, hosts = len(slots), []
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            if child.value or child.pending:
                break  # in transit (or a device node met after a host one: impossible)
            common = _common_length(child.key, tokens, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = self._clock
            hosts.append(child)
            node, pos = child, pos + common
        return TierMatch(slots, hosts[0].parent if hosts else node, hosts)

    def load(self, hosts: list[RadixNode], slots: list[int]) -> None:
        """Give the locked host nodes `hosts` (top down) the device `slots`,
        in order; each is in transit until its pass comes back."""
        if len(slots) != sum(len(n.host) for n in hosts):
            raise ValueError(f"load of {sum(len(n.host) for n in hosts)} tokens into {len(slots)}")
        at = 0
        for n in hosts:
            if n.lock_ref == 0 or n.value or n.pending:
                raise ValueError("only a locked host node can be loaded")
            n.value, at = slots[at : at + len(n.host)], at + len(n.host)
            n.pending = True
            self._locked += len(n.value)
            self._loads.append(Move(n, n.host, n.value))
        self.host_hit_tokens += len(slots)
        if hosts:
            log.info("cache.load", tokens=len(slots), nodes=len(hosts))

    # ---- passes carry the moves ------------------------------------------------

    def seal_moves(self, pass_id: int) -> tuple[list[Move], list[Move]]:
        moves = self._spills, self._loads
        self._spills, self._loads = [], []
        if moves[0] or moves[1]:
            self._sealed[pass_id] = moves
        return moves

    def settle_moves(self, pass_id: int, confirmed: bool) -> None:
        spills, loads = self._sealed.pop(pass_id, ([], []))
        for move in reversed(loads):  # bottom up: a rolled-back node has no device child
            self._settle_load(move.node, confirmed)
        for move in spills:
            node = move.node
            if node.parent is None:  # dropped since: its host slots are gone already
                continue
            if confirmed:
                node.pending = False
                self.spilled_tokens += len(node.host)
            else:
                self.rolled_back_tokens += len(node.host)
                self._drop_subtree(node)
        if confirmed and (spills or loads):
            log.debug(
                "cache.moves_confirmed", pass_id=pass_id, spills=len(spills), loads=len(loads)
            )
        if not confirmed and (spills or loads):
            log.warning(
                "cache.moves_rolled_back", pass_id=pass_id, spills=len(spills), loads=len(loads)
            )

    def _settle_load(self, node: RadixNode, confirmed: bool) -> None:
        node.pending = False
        if confirmed:
            self.loaded_tokens += len(node.value)
            return
        # rolled back: the requests that borrowed it were rolled back first
        assert node.lock_ref == 0 and not any(c.value for c in node.children.values())
        self.rolled_back_tokens += len(node.value)
        self._allocator.free(node.value)
        self._evictable -= len(node.value)
        node.value = []

    # ---- inserting ---------------------------------------------------------------

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> list[int]:
        """As RadixCache.insert; a host-only branch where the new leaf goes is
        dropped (the device copy is fresher), and where a node in transit
        stands in the way, the rest is not taken (returned with the duplicates)."""
        tokens, slots = list(tokens), list(slots)
        if len(tokens) != len(slots):
            raise ValueError(f"insert of {len(tokens)} tokens with {len(slots)} slots")
        node, cached = self._match(tokens)
        rest = len(cached)
        duplicates = [
            given for given, held in zip(slots[:rest], cached, strict=True) if given != held
        ]
        if rest == len(tokens):
            return duplicates
        blocker = node.children.get(tokens[rest])
        if blocker is not None:
            if blocker.pending:
                return duplicates + slots[rest:]
            self._drop_subtree(blocker)
        leaf = self._new_node(tokens[rest:], slots[rest:], node)
        node.children[leaf.key[0]] = leaf
        self._evictable += len(leaf.value)
        return duplicates

    # ---- evicting ------------------------------------------------------------------

    def evict(self, n: float) -> int:
        """Free at least n device slots if that many are evictable, LRU leaves
        of the device part first: a leaf with a host copy just leaves the
        device, one without is spilled to the host (evicting host LRU to make
        room), and only when the host cannot take it is it dropped, with the
        host nodes below it. Returns the device slots freed."""
        if n <= 0:
            return 0
        frontier = [(x.last_access, x.serial, x) for x in self._nodes() if self._device_leaf(x)]
        heapq.heapify(frontier)
        freed = spilled = dropped = 0
        while freed < n and frontier:
            _, _, leaf = heapq.heappop(frontier)
            parent = leaf.parent
            assert parent is not None
            size = len(leaf.value)
            if leaf.host:
                self._leave_device(leaf)
            elif self._spill(leaf):
                spilled += size
            else:
                dropped += size
                self._drop_subtree(leaf)
            freed += size
            if parent is not self._root and self._device_leaf(parent):
                heapq.heappush(frontier, (parent.last_access, parent.serial, parent))
        log.info(
            "cache.evict",
            asked=n,
            freed=freed,
            spilled=spilled,
            dropped=dropped,
            evictable=self._evictable,
        )
        return freed

    def evict_host(self, n: float) -> int:
        """Free at least n host slots if that many are evictable, LRU first:
        a node on both tiers keeps its device copy, a host-only leaf leaves
        the tree (its parent may follow). Returns the host slots freed."""
        if n <= 0:
            return 0
        frontier = [(x.last_access, x.serial, x) for x in self._nodes() if self._host_leaf(x)]
        heapq.heapify(frontier)
        freed = 0
        while freed < n and frontier:
            _, _, node = heapq.heappop(frontier)
            parent = node.parent
            assert parent is not None
            freed += len(node.host)
            self.host.free(node.host)
            node.host = []
            if not node.value:
                del parent.children[node.key[0]]
                node.parent = None
                if parent is not self._root and self._host_leaf(parent):
                    heapq.heappush(frontier, (parent.last_access, parent.serial, parent))
        self.host_evicted_tokens += freed
        log.info("cache.host_evict", asked=n, freed=freed)
        return freed

    def reset(self) -> int:
        if self._locked or self._sealed or any(n.pending for n in self._nodes()):
            raise RuntimeError("cannot reset the prefix cache while KV is locked or in transit")
        self.host.free([s for n in self._nodes() for s in n.host])
        for n in self._nodes():
            n.host = []
        return super().reset()

    # ---- internals -------------------------------------------------------------------

    def _spill(self, leaf: RadixNode) -> bool:
        """Move a device leaf to the host, if the host can take it."""
        host = self._host_slots(len(leaf.value))
        if host is None:
            return False
        self._spills.append(Move(leaf, leaf.value, host))
        leaf.host, leaf.pending = host, True
        self._leave_device(leaf)
        return True

    def _host_slots(self, n: int) -> list[int] | None:
        if n > self.host_capacity:
            return None
        if n > self.host.available:
            self.evict_host(n - self.host.available)
        return self.host.alloc(n) if n <= self.host.available else None

    def _leave_device(self, node: RadixNode) -> None:
        self._allocator.free(node.value)
        self._evictable -= len(node.value)
        node.value = []

    def _drop_subtree(self, top: RadixNode) -> None:
        """Drop an unlocked node and everything below it (all host-only)."""
        assert top.lock_ref == 0 and top.parent is not None
        gone = list(self._below(top))
        del top.parent.children[top.key[0]]
        if top.value:
            self._leave_device(top)
        for n in gone:
            self.host.free(n.host)
            n.host, n.parent = [], None
        ids = {id(n) for n in gone}
        self._spills = [m for m in self._spills if id(m.node) not in ids]

    def _below(self, top: RadixNode) -> Iterator[RadixNode]:
        stack = [top]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        assert not child.pending, "a node in transit is never split"
        host = child.host
        head = super()._split(child, at)
        if host:
            head.host, child.host = host[:at], host[at:]
        return head

    def _device_leaf(self, n: RadixNode) -> bool:
        return n.on_device and n.lock_ref == 0 and not any(c.value for c in n.children.values())

    def _host_leaf(self, n: RadixNode) -> bool:
        return bool(n.host) and self._host_free_to_go(n) and (bool(n.value) or not n.children)

    @staticmethod
    def _host_free_to_go(n: RadixNode) -> bool:
        return n.lock_ref == 0 and not n.pending


def prefix_cache(allocator: SlotAllocator, host_tokens: int) -> RadixCache:
    """The prefix cache of a server: with a host tier of `host_tokens` slots, or none."""
    if host_tokens < 0:
        raise ValueError(f"host KV tokens must be >= 0, not {host_tokens}")
    if host_tokens == 0:
        return RadixCache(allocator)
    return TieredCache(allocator, SlotAllocator(host_tokens + 1))
