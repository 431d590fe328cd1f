"""The gloo process group the ring's links run on.

Liveness is judged in asyncio (`ring/watchdog.py`), never by a gloo timeout: a
gloo wait that times out poisons every later receive of the process group, so
the group's operation timeout is set far beyond any run. Only the rendezvous
(every rank reaching the TCP store) has a short, real deadline, so a rank that
never starts is reported instead of waited for.
"""

from __future__ import annotations

import datetime
import sys

import structlog
import torch.distributed as dist

log = structlog.get_logger(__name__)

# Longer than any run; gloo needs a finite value.
OPERATION_TIMEOUT = datetime.timedelta(days=30)


def init_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    connect_timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Join the gloo group of `world_size` ranks whose TCP store rank 0
    serves at `master_addr:master_port`; returns the group the links use.

    Raises RuntimeError (from torch) when the other ranks do not all arrive
    within `connect_timeout_s`."""
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
    return dist.group.WORLD


def close_group() -> None:
    """Leave the process group, if one was joined. Safe while a link reader
    is still blocked in a receive (its thread is a daemon; measured: neither
    this call nor interpreter exit hangs on it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
