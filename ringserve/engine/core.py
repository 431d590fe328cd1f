"""Rank 0's engine on one process: the model, the caches, the scheduler and
the stage for its layers, stepped one pass at a time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.pool import KVPool
from ringserve.cache.radix import RadixCache
from ringserve.engine.params import SamplingParams
from ringserve.engine.request import Request, RequestFactory
from ringserve.engine.runner import Runner
from ringserve.engine.scheduler import Scheduler, SchedulerConfig
from ringserve.engine.stage import PassFailed, Stage
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model
from ringserve.models.tokenizer import Tokenizer
from ringserve.ring.messages import Void

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


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything rank 0 needs to build its engine."""

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

    def scheduler_config(self, cfg: ModelConfig, passes_in_flight: int = 1) -> SchedulerConfig:
        return SchedulerConfig(
            max_model_len=min(self.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings),
            max_tokens_per_pass=self.max_tokens_per_pass,
            chunk_size=self.chunk_size,
            max_batch=self.max_batch,
            max_retries=self.max_retries,
            prefix_reuse=self.prefix_reuse,
            passes_in_flight=passes_in_flight,
        )


class Engine:
    """Single-rank engine: schedule a pass, run it, take its output."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = cfg = ModelConfig.from_dir(config.model_dir)
        self.dtype = resolve_dtype(config.dtype, cfg)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        device = torch.device(config.device)
        layers = range(cfg.num_layers)
        model = load_model(config.model_dir, cfg, layers, TORCH_DTYPES[self.dtype], device)
        pool = KVPool(
            cfg.num_layers, config.kv_capacity_tokens, cfg.num_kv_heads, cfg.head_dim,
            TORCH_DTYPES[self.dtype], device,
        )
        allocator = SlotAllocator(config.kv_capacity_tokens)
        self.scheduler = Scheduler(config.scheduler_config(cfg), allocator, RadixCache(allocator))
        self.stage = Stage(Runner(model, pool, device, layers, cfg.num_layers), rank=0)
        self.new_request = RequestFactory(frozenset(cfg.eos_token_ids))
        log.info("engine.ready", model=str(config.model_dir), dtype=self.dtype, kv_bytes=pool.nbytes)

    def submit(self, prompt: list[int], params: SamplingParams) -> Request:
        req = self.new_request(prompt, params)
        self.scheduler.add(req)
        return req

    def step(self) -> list[Request]:
        """Run one pass; returns the requests it touched (empty when idle)."""
        decision = self.scheduler.schedule()
        if decision is None:
            return []
        try:
            rows = self.stage.apply(decision)
            out = self.stage.compute(decision, rows, None)
        except PassFailed as exc:
            return self.scheduler.on_void(Void(decision.pass_id, 0, str(exc)))
        return self.scheduler.on_output(out)
