"""Building one rank: its model slice, KV pool and stage; on rank 0 also the
scheduler, caches and tokenizer. One definition used by every way of
starting ranks (offline LLM, launcher, rank processes)."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from ringserve import logs
from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.host_pool import HostPool
from ringserve.cache.pool import KVPool
from ringserve.cache.tiers import prefix_cache
from ringserve.config import EngineConfig, rank_device, resolve_dtype
from ringserve.engine.drafter import Drafter
from ringserve.engine.grammar import mask_words
from ringserve.engine.runner import Runner
from ringserve.engine.stage import FaultyStage, Stage
from ringserve.kernels.cpu_native import CpuKernels
from ringserve.launch.progress import LoadProgress
from ringserve.models.config import ModelConfig
from ringserve.models.decode_graphs import DecodeGraphs
from ringserve.models.loader import load_model
from ringserve.models.slice import ModelSlice
from ringserve.models.tokenizer import Tokenizer
from ringserve.plan.audit import check_allocation, check_draft
from ringserve.plan.draft import draft_config
from ringserve.plan.ledger import visible_gpus
from ringserve.ring.announce import Expectation
from ringserve.ring.codec import TensorSpec
from ringserve.ring.faults import FaultPlan
from ringserve.ring.messages import Decision, Message
from ringserve.sched.request import RequestFactory
from ringserve.sched.scheduler import Scheduler, SchedulerConfig

log = structlog.get_logger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_stage(config: EngineConfig, cfg: ModelConfig, layers: range, rank: int) -> Stage:
    """Load this rank's slice and size its pool with the ring's one capacity."""
    dtype = TORCH_DTYPES[resolve_dtype(config.dtype, cfg.torch_dtype)]
    device = place_rank(config, rank)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    progress = LoadProgress(rank)
    model = load_model(config.model_dir, cfg, layers, dtype, device, progress=progress)
    pool = KVPool(
        len(layers), config.kv_capacity_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )
    log.info("pool.allocated", rank=rank, layers=f"{layers.start}:{layers.stop}", bytes=pool.nbytes)
    host = None
    if config.host_kv_tokens:
        shape = (cfg.num_kv_heads, cfg.head_dim, dtype, device)
        host = HostPool(len(layers), config.host_kv_tokens + 1, *shape)
        log.info("host_pool.allocated", rank=rank, tokens=config.host_kv_tokens, bytes=host.nbytes)
    native = cpu_kernels(config, device)
    pack_weights(model, config, device)
    graphs = None
    if device.type == "cuda" and not config.enforce_eager:
        graphs = DecodeGraphs(
            model, pool, device, first=layers.start == 0, max_rows=config.max_batch
        )
    runner = Runner(
        model,
        pool,
        device,
        layers,
        cfg.num_layers,
        host=host,
        native=native,
        gather_limit=config.max_tokens_per_pass,
        graphs=graphs,
    )
    check_allocation(config.plan, rank, runner, config.max_tokens_per_pass, config.max_batch)
    faults = FaultPlan.from_env(rank)
    return FaultyStage(runner, rank, faults) if faults.touches_stage else Stage(runner, rank)


def build_drafter(config: EngineConfig, cfg: ModelConfig) -> Drafter | None:
    """Rank 0's draft model for `--speculative draft`, all of its layers, with
    a KV pool of the ring's token capacity; None without one."""
    if config.speculative != "draft" or config.draft_model is None:
        return None
    draft_cfg = draft_config(config.draft_model, cfg)
    dtype = TORCH_DTYPES[resolve_dtype(config.dtype, draft_cfg.torch_dtype)]
    device = place_rank(config, 0)
    layers = range(draft_cfg.num_layers)
    model = load_model(config.draft_model, draft_cfg, layers, dtype, device)
    pool = KVPool(
        len(layers),
        config.kv_capacity_tokens,
        draft_cfg.num_kv_heads,
        draft_cfg.head_dim,
        dtype,
        device,
    )
    log.info("draft.loaded", layers=len(layers), pool_bytes=pool.nbytes)
    pack_weights(model, config, device)
    drafter = Drafter(
        model,
        pool,
        device,
        cpu_kernels(config, device),
        gather_limit=config.max_tokens_per_pass,
        max_tokens=config.max_tokens_per_pass,
        max_positions=draft_cfg.context_limit,
    )
    if draft_cfg.context_limit < cfg.context_limit:
        log.info(
            "draft.positions",
            draft=draft_cfg.context_limit,
            served=cfg.context_limit,
            note="past the draft's positions a request is not drafted for",
        )
    check_draft(config.plan, drafter, config.max_tokens_per_pass, config.max_batch)
    return drafter


def place_rank(config: EngineConfig, rank: int) -> torch.device:
    """Where rank `rank` runs (`config.rank_device`, the planner's rule
    too). On a GPU it is made the process's current device: Triton launches
    its kernels on the current device, whatever the tensors' device."""
    device = torch.device(rank_device(config.device, rank, visible_gpus()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def native_cpu(config: EngineConfig, device: torch.device) -> bool:
    """Whether this rank runs on the CPU with `cpu_kernels` native."""
    return device.type == "cpu" and config.cpu_kernels == "native"


def cpu_kernels(config: EngineConfig, device: torch.device) -> CpuKernels | None:
    """The in-place CPU decode attention kernel, where the device is the
    CPU, the config asks for it and it builds here; None: the torch path."""
    return CpuKernels.load() if native_cpu(config, device) else None


def pack_weights(model: ModelSlice, config: EngineConfig, device: torch.device) -> None:
    """On the CPU with `cpu_kernels` native, the matmul weights that run
    faster packed (kernels/packed_linear.py) are packed once, here."""
    if native_cpu(config, device):
        packed = model.pack_linear_weights()
        span = f"{model.layer_range.start}:{model.layer_range.stop}"
        log.debug("weights.packed", layers=span, matrices=packed)


def report_loaded(stage: Stage) -> None:
    """One line per rank on stderr: the launcher's loading progress."""
    runner = stage.runner
    mib = runner.pool.nbytes / 2**20
    logs.say(
        f"rank {stage.rank} loaded layers {runner.layers.start}-{runner.layers.stop - 1}, "
        f"KV pool of {runner.pool.capacity} tokens ({mib:.1f} MiB), on {runner.device}"
    )


def hidden_announcement(config: EngineConfig, cfg: ModelConfig) -> Expectation:
    """What a Decision announces on every link: the tensor of hidden states
    its pass's Hidden carries, `(tokens, hidden_size)` in the serving dtype,
    and, when entries are masked, their packed grammar masks `(masked,
    words)` int32, so the receiver posts its receives before the Hidden
    arrives."""
    dtype = TORCH_DTYPES[resolve_dtype(config.dtype, cfg.torch_dtype)]
    words = mask_words(cfg.vocab_size)

    def expect(msg: Message) -> list[TensorSpec]:
        if not isinstance(msg, Decision):
            return []
        tokens = sum(len(e.tokens) for e in msg.entries)
        if not tokens:
            return []
        masked = sum(e.masked for e in msg.entries)
        masks = [TensorSpec(torch.int32, (masked, words))] if masked else []
        return [TensorSpec(dtype, (tokens, cfg.hidden_size)), *masks]

    return expect


@dataclass(slots=True)
class RankZero:
    """What only rank 0 holds: the scheduler (with the allocator and the
    prefix cache), the tokenizer, and the request factory."""

    scheduler: Scheduler
    tokenizer: Tokenizer | None
    new_request: RequestFactory


def default_depth(world: int) -> int:
    """The most passes in flight a ring of `world` ranks runs by default: one
    per rank keeps every stage busy, and a ring of several opens up to two
    more while requests wait for them (`SchedulerConfig.open_slots`), so the
    hops and rank 0's own work between passes hide behind full passes, and
    waiting requests ride in a pass of their own instead of waiting for one.
    Measured side by side with full passes of 32 rows: pp 2 with 4 in flight
    against 3, 1.17x (built-in model) and 1.15x (111M Llama); pp 3 with 5
    against 4, 1.22x."""
    return world + 2 if world > 1 else 1


def build_rank_zero(config: EngineConfig, cfg: ModelConfig, world: int) -> RankZero:
    depth = config.passes_in_flight or default_depth(world)
    if cfg.context_limit < cfg.max_position_embeddings:
        log.warning(
            "model.sliding_window",
            window=cfg.sliding_window,
            positions=cfg.max_position_embeddings,
            note="contexts are served up to the window, within which full attention agrees",
        )
    allocator = SlotAllocator(config.kv_capacity_tokens)
    scheduler = Scheduler(
        SchedulerConfig.from_engine(
            config, cfg.context_limit, depth, busy_passes=min(world, depth)
        ),
        allocator,
        prefix_cache(allocator, config.host_kv_tokens),
    )
    tokenizer = Tokenizer.from_dir(config.model_dir)
    if tokenizer is None:
        others = sorted(p.name for p in config.model_dir.glob("tokenizer*") if p.is_file())
        log.warning(
            "tokenizer.none",
            model_dir=str(config.model_dir),
            found=others,
            note="no tokenizer.json: prompts must come as token ids, and text is not written",
        )
    return RankZero(scheduler, tokenizer, RequestFactory(frozenset(cfg.eos_token_ids)))
