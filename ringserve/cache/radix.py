"""Rank 0's prefix cache: a radix tree over token ids whose values are the KV
slots holding those tokens (DESIGN §4). Pure Python over ints, deterministic:
recency is a logical clock, ties break by node creation order."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import structlog

from ringserve.cache.allocator import SlotAllocator

log = structlog.get_logger(__name__)


class RadixNode:
    """One edge of the tree: `key` token ids and the `value` slots holding
    them, equally long and non-empty everywhere but the root.

    `lock_ref` counts the locks taken on this node or a descendant, so it
    never exceeds its parent's; `last_access` is the cache's clock at the last
    match or insert through this node. Opaque to callers: a handle to pass
    back to lock and unlock.

    With a host tier (`cache/tiers.py`) a node's KV may live on the device
    (`value`), in host memory (`host`) or both; an empty list means "not in
    that tier". `pending` marks a copy between the tiers that some pass in
    flight carries: until its terminal confirms it, the copy's target is
    not trusted."""

    __slots__ = (
        "key",
        "value",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "serial",
        "host",
        "pending",
    )

    def __init__(
        self, key: list[int], value: list[int], parent: RadixNode | None, serial: int, clock: int
    ) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, RadixNode] = {}  # first token of the child's key -> child
        self.lock_ref = 0
        self.last_access = clock
        self.serial = serial
        self.host: list[int] = []
        self.pending = False

    @property
    def on_device(self) -> bool:
        """Whether the node's device KV can be read: there and not in transit."""
        return bool(self.value) and not self.pending


class MatchResult(NamedTuple):
    slots: list[int]  # slots of the longest cached prefix (len == matched tokens)
    node: RadixNode  # deepest node covering exactly that prefix (root when nothing matched)


class TierMatch(NamedTuple):
    """The longest prefix cached in either tier: `slots` and `node` as in
    MatchResult for its device part, then `hosts`, the nodes below `node`
    (top down) whose KV is only in host memory and could be loaded back."""

    slots: list[int]
    node: RadixNode
    hosts: list[RadixNode]

    @property
    def host_tokens(self) -> int:
        return sum(len(n.host) for n in self.hosts)


class Move(NamedTuple):
    """One node's KV copied between the tiers: slots `src` to slots `dst`
    (device to host for a spill, host to device for a load)."""

    node: RadixNode
    src: list[int]
    dst: list[int]


class RadixCache:
    """Prefix tree over token ids -> KV slot indices.

    Invariants: (1) the tree owns the slots it holds and they leave it only
    through `evict` or `reset`, back to the allocator; (2) lock refs are
    monotone toward the root, so every unlocked node has only unlocked
    descendants, the leaf frontier reaches all of them, and `evictable_size`
    (slots in unlocked nodes) is exactly what `evict(math.inf)` pays;
    (3) `evictable_size + locked_size == total_size`.

    Eviction frees whole leaves, least recently used first, until it has freed
    at least what was asked; so it overshoots the ask by less than the last
    leaf's length, and the receipt it returns is always the slots freed.
    """

    def __init__(self, allocator: SlotAllocator) -> None:
        self._allocator = allocator
        self._clock = 0
        self._serial = 0
        self._evictable = 0
        self._locked = 0
        self._root = self._new_node([], [], None)

    @property
    def evictable_size(self) -> int:
        """Slots in nodes with lock_ref == 0: exactly what evict(math.inf) would free now."""
        return self._evictable

    @property
    def locked_size(self) -> int:
        """Slots in nodes with lock_ref > 0."""
        return self._locked

    @property
    def total_size(self) -> int:
        """All slots held by the tree."""
        return self._evictable + self._locked

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """The longest cached prefix of tokens; splits the edge it ends inside."""
        node, slots = self._match(list(tokens))
        return MatchResult(slots, node)

    # ---- the host tier: none here (cache/tiers.py has one) ---------------------

    @property
    def host_capacity(self) -> int:
        """Usable host slots; 0: there is no host tier."""
        return 0

    def match_tiers(self, tokens: Sequence[int]) -> TierMatch:
        """The longest prefix cached on the device or in host memory."""
        found = self.match_prefix(tokens)
        return TierMatch(found.slots, found.node, [])

    def seal_moves(self, pass_id: int) -> tuple[list[Move], list[Move]]:
        """The spills and loads decided since the last pass, now carried by `pass_id`."""
        return [], []

    def settle_moves(self, pass_id: int, confirmed: bool) -> None:
        """The terminal of `pass_id` arrived: confirm its moves, or roll them back."""

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> list[int]:
        """Cache tokens at slots, taking the slots of positions not yet cached.

        Returns the given slots it did not take because their position is
        already cached under a different slot: the caller still owns those.
        Given slots that already are the tree's are neither taken nor returned."""
        tokens, slots = list(tokens), list(slots)
        if len(tokens) != len(slots):
            raise ValueError(f"insert of {len(tokens)} tokens with {len(slots)} slots")
        node, cached = self._match(tokens)
        duplicates = [
            given for given, held in zip(slots[: len(cached)], cached, strict=True) if given != held
        ]
        if len(cached) < len(tokens):
            leaf = self._new_node(tokens[len(cached) :], slots[len(cached) :], node)
            node.children[leaf.key[0]] = leaf
            self._evictable += len(leaf.value)
        return duplicates

    def lock(self, node: RadixNode) -> None:
        """Pin node and its ancestors against eviction (lock_ref += 1 on each)."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.value)
                self._locked += len(n.value)
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Undo one lock(node)."""
        path = self._path(node)
        if any(n.lock_ref == 0 for n in path):
            raise ValueError("unlock of a radix node that is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked -= len(n.value)
                self._evictable += len(n.value)

    def evict(self, n: float) -> int:
        """Free at least n slots if that many are evictable (whole leaves, LRU
        first; a parent left childless joins the frontier); returns the
        number actually freed. Pass math.inf to free everything evictable."""
        if n <= 0:
            return 0
        frontier = [(leaf.last_access, leaf.serial, leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(frontier)
        freed = 0
        while freed < n and frontier:
            _, _, leaf = heapq.heappop(frontier)
            parent = leaf.parent
            freed += self._drop_leaf(leaf)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(frontier, (parent.last_access, parent.serial, parent))
        log.info("cache.evict", asked=n, freed=freed, evictable=self._evictable)
        return freed

    def reset(self) -> int:
        """Drop the whole tree; returns the slots freed.
        Handles from before the reset are rejected by lock and unlock."""
        if self._locked:
            raise RuntimeError(
                f"cannot reset the prefix cache: {self._locked} slots are locked by running "
                "requests; release them first"
            )
        slots = [slot for node in self._nodes() for slot in node.value]
        self._allocator.free(slots)
        self._evictable = 0
        self._root = self._new_node([], [], None)
        log.info("cache.reset", freed=len(slots))
        return len(slots)

    # ---- internals -----------------------------------------------------------

    def _new_node(self, key: list[int], value: list[int], parent: RadixNode | None) -> RadixNode:
        self._serial += 1
        return RadixNode(key, value, parent, self._serial, self._clock)

    def _match(self, tokens: list[int]) -> tuple[RadixNode, list[int]]:
        """Deepest node covering the longest cached prefix, and its slots;
        touches every node on the path with one new clock tick."""
        self._clock += 1
        node, pos, slots = self._root, 0, []
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            if not child.on_device:
                break
            common = _common_length(child.key, tokens, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = self._clock
            slots.extend(child.value)
            node, pos = child, pos + common
        return node, slots

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut child's edge after `at` tokens. A new node takes the head and
        child keeps the tail, so existing handles to child still cover the
        same prefix; the head inherits child's lock_ref because every lock
        through child passes through it."""
        parent = child.parent
        assert parent is not None
        head = self._new_node(child.key[:at], child.value[:at], parent)
        head.lock_ref = child.lock_ref
        head.last_access = child.last_access
        parent.children[head.key[0]] = head
        child.key, child.value, child.parent = child.key[at:], child.value[at:], head
        head.children[child.key[0]] = child
        return head

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """node and its ancestors, root excluded; rejects a node not in this tree."""
        path = []
        while node is not self._root:
            if node.parent is None:
                raise ValueError(
                    "radix node is not in this cache (evicted, or from before a reset)"
                )
            path.append(node)
            node = node.parent
        return path

    def _drop_leaf(self, leaf: RadixNode) -> int:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[leaf.key[0]]
        leaf.parent = None
        self._allocator.free(leaf.value)
        self._evictable -= len(leaf.value)
        return len(leaf.value)

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children, in insertion order."""
        stack = list(reversed(self._root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def _unlocked_leaves(self) -> Iterator[RadixNode]:
        return (n for n in self._nodes() if not n.children and n.lock_ref == 0)


def _common_length(key: list[int], tokens: list[int], start: int) -> int:
    limit = min(len(key), len(tokens) - start)
    i = 0
    while i < limit and key[i] == tokens[start + i]:
        i += 1
    return i
