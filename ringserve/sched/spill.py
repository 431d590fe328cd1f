"""The host tier in rank 0's policy (DESIGN §3.9): an admission borrows its
cached prefix and loads the host part of it back into fresh device slots;
each pass carries the spills and loads decided with it. Pure Python; the
moves themselves are the tiered cache's (`cache/tiers.py`)."""

from __future__ import annotations

from ringserve.cache.radix import Move, RadixCache, TierMatch
from ringserve.ring.messages import Decision, TierCopy
from ringserve.sched.kvbook import KVBook
from ringserve.sched.passbook import Draft, PassBook
from ringserve.sched.relief import Relief
from ringserve.sched.request import Request


def borrow_prefix(
    kv: KVBook, relief: Relief, req: Request, found: TierMatch, limit: int, draft: Draft
) -> tuple[list[int], list[int]] | None:
    """Lock the request's cached prefix and take the slots of its next chunk
    (at most `limit` tokens), paying first for loading the prefix's host part
    back. When the device cannot pay for both, the request computes the host
    part itself. Returns (reuse, slots), or None (nothing taken: it parks)."""
    for hosts in [found.hosts, []] if found.hosts else [[]]:
        node = hosts[-1] if hosts else found.node
        loaded = sum(len(h.host) for h in hosts)
        n = min(len(req.tokens) - len(found.slots) - loaded, limit)
        kv.borrow(req, node)
        slots = relief.alloc(loaded + n, draft, asker=None)
        if slots is not None:
            if hosts:
                kv.cache.load(hosts, slots[:loaded])
            return found.slots + slots[:loaded], slots[loaded:]
        kv.give_back(req)
    return None


def seal_with_moves(passes: PassBook, cache: RadixCache, draft: Draft) -> Decision:
    """Seal the draft into the next pass, carrying every move decided since
    the last one (an empty call to the scheduler may have spilled too)."""
    spills, loads = cache.seal_moves(passes.next_pass_id)
    return passes.seal(draft, _copies(spills), _copies(loads))


def _copies(moves: list[Move]) -> list[TierCopy]:
    return [TierCopy(m.src, m.dst) for m in moves]
