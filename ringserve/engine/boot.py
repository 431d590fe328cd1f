"""Building one rank: its model slice, KV pool and stage; on rank 0 also the
scheduler, caches and tokenizer. One definition used by every way of
starting ranks (offline LLM, launcher, rank processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.pool import KVPool
from ringserve.cache.radix import RadixCache
from ringserve.engine.request import RequestFactory
from ringserve.engine.runner import Runner
from ringserve.engine.scheduler import Scheduler, SchedulerConfig
from ringserve.engine.stage import Stage
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model
from ringserve.models.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, cfg: ModelConfig) -> str:
    """`auto` serves in the checkpoint's dtype, except float16, which is slow
    on CPUs and is served as float32."""
    if dtype == "auto":
        dtype = cfg.torch_dtype if cfg.torch_dtype in TORCH_DTYPES else "float32"
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)} or 'auto', not {dtype!r}")
    return dtype


def layer_range(split: list[int], rank: int) -> range:
    start = sum(split[:rank])
    return range(start, start + split[rank])


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes the engine of every rank."""

    model_dir: Path
    dtype: str = "float32"
    max_model_len: int | None = None
    kv_capacity_tokens: int = 16384
    max_tokens_per_pass: int = 512
    chunk_size: int = 256
    max_batch: int = 64
    prefix_reuse: bool = True
    max_retries: int = 3
    device: str = "cpu"
    wedge_timeout_s: float = 30.0
    heartbeat_s: float = 1.0
    layer_split: tuple[int, ...] | None = field(default=None)
    torch_threads: int | None = None
    passes_in_flight: int | None = None  # micro-batch slots S; default: the number of ranks
    plan: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 2:
            raise ValueError("kv_capacity_tokens must be >= 2")
        if self.wedge_timeout_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError("wedge_timeout_s and heartbeat_s must be > 0")

    def scheduler_config(self, cfg: ModelConfig, passes_in_flight: int = 1) -> SchedulerConfig:
        limit = cfg.max_position_embeddings
        return SchedulerConfig(
            max_model_len=min(self.max_model_len or limit, limit),
            max_tokens_per_pass=self.max_tokens_per_pass,
            chunk_size=self.chunk_size,
            max_batch=self.max_batch,
            max_retries=self.max_retries,
            prefix_reuse=self.prefix_reuse,
            passes_in_flight=passes_in_flight,
        )


def build_stage(config: EngineConfig, cfg: ModelConfig, layers: range, rank: int) -> Stage:
    """Load this rank's slice and size its pool with the ring's one capacity."""
    dtype = TORCH_DTYPES[resolve_dtype(config.dtype, cfg)]
    device = torch.device(config.device)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    model = load_model(config.model_dir, cfg, layers, dtype, device)
    pool = KVPool(
        len(layers), config.kv_capacity_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )
    log.info("pool.allocated", rank=rank, layers=f"{layers.start}:{layers.stop}", bytes=pool.nbytes)
    runner = Runner(model, pool, device, layers, cfg.num_layers)
    from ringserve.engine.sizing import check_allocation

    check_allocation(config.plan, rank, runner, config.max_tokens_per_pass, config.max_batch)
    return Stage(runner, rank=rank)


@dataclass(slots=True)
class RankZero:
    """What only rank 0 holds: the scheduler (with the allocator and the
    prefix cache), the tokenizer, and the request factory."""

    scheduler: Scheduler
    tokenizer: Tokenizer | None
    new_request: RequestFactory


def build_rank_zero(config: EngineConfig, cfg: ModelConfig, world: int) -> RankZero:
    passes_in_flight = config.passes_in_flight or world
    allocator = SlotAllocator(config.kv_capacity_tokens)
    scheduler = Scheduler(
        config.scheduler_config(cfg, passes_in_flight), allocator, RadixCache(allocator)
    )
    return RankZero(
        scheduler,
        Tokenizer.from_dir(config.model_dir),
        RequestFactory(frozenset(cfg.eos_token_ids)),
    )
