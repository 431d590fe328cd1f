"""The one `EngineConfig`: everything that shapes the engine of every rank,
with its defaults declared here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVING_DTYPES = ("bfloat16", "float32")
PLAN_FOR = ("capacity", "throughput", "balanced")  # what the planner optimises (plan/objective.py)
KV_TOKENS_PER_WAITING = 16  # the default queue bound: one waiting request per this many KV slots


class UserError(ValueError):
    """A mistake the person running ringserve can fix (a model that is not
    there, a malformed option, a port in use). The command line prints its
    message as one line and exits 2; the message says what to change."""


def resolve_dtype(dtype: str, checkpoint_dtype: str) -> str:
    """`auto` serves in the checkpoint's dtype, except float16, which is slow
    on CPUs and is served as float32."""
    if dtype == "auto":
        dtype = checkpoint_dtype if checkpoint_dtype in SERVING_DTYPES else "float32"
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype must be one of {list(SERVING_DTYPES)} or 'auto', not {dtype!r}")
    return dtype


def layer_range(split: list[int] | tuple[int, ...], rank: int) -> range:
    """The layers rank `rank` holds under `split`."""
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
    plan_for: str = "balanced"
    rank_speed: tuple[float, ...] | None = None  # per layer, relative; None: all equal
    min_kv_tokens: int | None = None  # the planner refuses a capacity below this
    max_waiting_requests: int | None = None  # default: kv_capacity_tokens // KV_TOKENS_PER_WAITING
    queue_timeout_s: float | None = None  # None: a request waits as long as it takes
    host_kv_tokens: int = 0  # host tier slots per rank (the same on every rank); 0: none
    host_kv_mib: int | None = None  # host tier budget per rank; the planner solves the tokens
    plan: dict[str, Any] | None = field(default=None, compare=False)
    # vLLM's --structured-outputs-config: a JSON object (engine/grammar.py)
    structured_outputs_config: str | None = None

    def __post_init__(self) -> None:
        if self.plan_for not in PLAN_FOR:
            raise ValueError(f"plan_for must be one of {list(PLAN_FOR)}, not {self.plan_for!r}")
        if self.rank_speed is not None:
            speeds = tuple(float(s) for s in self.rank_speed)
            if not speeds or not all(s > 0 for s in speeds):
                raise ValueError(f"rank_speed must be positive factors, got {list(speeds)}")
            object.__setattr__(self, "rank_speed", speeds)  # a list given to LLM(...) too
        if self.min_kv_tokens is not None and self.min_kv_tokens < 2:
            raise ValueError("min_kv_tokens must be >= 2")
        if self.host_kv_tokens < 0 or (self.host_kv_mib is not None and self.host_kv_mib < 1):
            raise ValueError("host_kv_tokens must be >= 0 and host_kv_mib >= 1")
        if self.kv_capacity_tokens < 2:
            raise ValueError("kv_capacity_tokens must be >= 2")
        if self.wedge_timeout_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError("wedge_timeout_s and heartbeat_s must be > 0")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError("queue_timeout_s must be > 0 (leave it out for no timeout)")

    @property
    def waiting_limit(self) -> int:
        """How many requests may wait for admission before more are refused."""
        if self.max_waiting_requests is not None:
            return self.max_waiting_requests
        return max(1, self.kv_capacity_tokens // KV_TOKENS_PER_WAITING)
