"""The gloo process group the ring's links run on.

Liveness is judged in asyncio (`ring/watchdog.py`), never by a gloo timeout: a
gloo wait that times out poisons every later receive of the process group, so
the group's operation timeout is set far beyond any run. Only the rendezvous
(every rank reaching the TCP store) has a short, real deadline, so a rank that
never starts is reported instead of waited for.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

# Longer than any run; gloo needs a finite value.
OPERATION_TIMEOUT = datetime.timedelta(days=30)


class RingMismatch(ValueError):
    """The ranks were started with different ring settings (layer split, KV
    capacity, ...): a ring whose ranks disagree would corrupt outputs
    silently, so none of them starts."""


def init_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    connect_timeout_s: float = 120.0,
    terms: bytes | None = None,
) -> dist.ProcessGroup:
    """Join the gloo group of `world_size` ranks whose TCP store rank 0
    serves at `master_addr:master_port`; returns the group the links use.
    With `terms` (what every rank must agree on, `EngineConfig.ring_terms`),
    every rank checks that all ranks were given the same: each node of a
    multi-node ring sizes it on its own, and nodes that measured different
    memory plan different rings.

    Raises RuntimeError (from torch) when the other ranks do not all arrive
    within `connect_timeout_s`, RingMismatch when the terms differ."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size} ranks")
    store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=connect_timeout_s),
    )
    hook = sys.excepthook
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=OPERATION_TIMEOUT
    )
    # torch wraps the process's excepthook to prefix `[rank0]: ` to each line,
    # once more at every group joined: a program that opens one LLM after
    # another would print its tracebacks with the prefix stacked. The hook is
    # the program's, not the ring's.
    sys.excepthook = hook
    log.info(
        "group.joined", rank=rank, world_size=world_size, master=f"{master_addr}:{master_port}"
    )
    if terms is not None:
        check_terms(rank, world_size, terms)
    return dist.group.WORLD


def check_terms(rank: int, world_size: int, terms: bytes) -> None:
    """Every rank's digest of its terms, gathered on every rank (one
    collective that every rank joins, before any link opens); RingMismatch
    naming the ranks that differ from rank 0, and in what (the terms
    themselves are gathered then: a second collective, which every rank
    joins since every rank sees the same digests)."""
    digest = hashlib.blake2b(terms, digest_size=16).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    differ = [r for r in range(world_size) if not torch.equal(every[r], every[0])]
    if differ:
        log.error("group.terms_differ", rank=rank, ranks=differ, terms=terms.decode())
        gathered = _gather_bytes(terms, world_size)
        what = "; ".join(f"rank {r}: {terms_differ(gathered[0], gathered[r])}" for r in differ)
        raise RingMismatch(
            f"ranks {differ} were started with ring settings other than rank 0's ({what}): "
            "give every node the same model and options"
        )


def _gather_bytes(data: bytes, world_size: int) -> list[bytes]:
    """Every rank's `data` (of any length), on every rank."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return [bytes(t[: int(n)].tolist()) for t, n in zip(every, sizes, strict=True)]


def terms_differ(ours: bytes, theirs: bytes, shown: int = 4) -> str:
    """What differs between two ranks' terms (JSON objects, the model's
    config one level down), as `name X (rank 0's: Y)`, at most `shown`."""
    try:
        a, b = _flat(json.loads(ours)), _flat(json.loads(theirs))
    except ValueError:
        return "terms that cannot be read"
    names = sorted(k for k in a.keys() | b.keys() if a.get(k, _ABSENT) != b.get(k, _ABSENT))
    said = [
        f"{k} {_shown(b.get(k, _ABSENT))} (rank 0's: {_shown(a.get(k, _ABSENT))})" for k in names
    ]
    more = f" and {len(said) - shown} more" if len(said) > shown else ""
    return ", ".join(said[:shown]) + more if said else "the same terms in another form"


_ABSENT = object()


def _flat(terms: dict) -> dict:
    flat = {k: v for k, v in terms.items() if k != "model_config"}
    config = terms.get("model_config")
    if isinstance(config, dict):
        flat.update({f"config.json {k}": v for k, v in config.items()})
    elif config is not None:
        flat["config.json"] = config
    return flat


def _shown(value: object) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)[:60]


def close_group() -> None:
    """Leave the process group, if one was joined. Safe while a link reader
    is still blocked in a receive (its thread is a daemon; measured: neither
    this call nor interpreter exit hangs on it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
