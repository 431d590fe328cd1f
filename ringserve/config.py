"""The one `EngineConfig`: everything that shapes the engine of every rank,
with its defaults declared here and nowhere else."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SERVING_DTYPES = ("bfloat16", "float32")
PLAN_FOR = ("capacity", "throughput", "balanced")  # what the planner optimises (plan/objective.py)
KV_TOKENS_PER_WAITING = 16  # the default queue bound: one waiting request per this many KV slots
# 16 TiB: a memory figure past it (a rank's budget, a host tier) was not written in MiB
MAX_MIB = 1 << 24
SPECULATIVE_METHODS = ("ngram", "draft")  # who proposes speculative tokens (sched/speculation.py)
CPU_KERNELS = ("native", "torch")  # how CPU decode passes attend (kernels/cpu_native.py)
# What shapes the ring: every rank must hold the same (ring_terms), and a
# multi-node ring takes them from node 0 (with_ring_of)
RING_FIELDS = (
    "dtype", "layer_split", "kv_capacity_tokens", "host_kv_tokens", "max_model_len",
    "max_tokens_per_pass", "chunk_size", "max_batch", "speculative",
    "num_speculative_tokens", "structured_outputs_config",
)  # fmt: skip
DEVICE_KINDS = ("auto", "cpu", "cuda")  # `device`'s words; or one device per rank, cpu,cuda:1


def device_list(device: str) -> list[str]:
    """`device` split into its per-rank entries, each checked: `cpu`,
    `cuda` or `cuda:N`. One entry (`auto`, `cpu`, `cuda`) applies to every
    rank."""
    parts = [part.strip() for part in device.split(",")]
    for part in parts:
        kind, _, index = part.partition(":")
        known = part in DEVICE_KINDS or (kind == "cuda" and index.isdigit())
        if not known or (part == "auto" and len(parts) > 1):
            raise ValueError(
                f"device must be auto, cpu, cuda, or one per rank such as cuda:0,cuda:1 "
                f"(cpu, cuda or cuda:N each), not {device!r}"
            )
    return parts


def rank_device(device: str, rank: int, cuda_count: int) -> str:
    """The one rule of where rank `rank` runs: `cuda` puts rank r on
    `cuda:(r % cuda_count)` (ranks share a GPU when there are more ranks
    than GPUs); `auto` is `cuda` where there is a GPU and `cpu` elsewhere; a
    per-rank list names each rank's device."""
    parts = device_list(device)
    part = parts[0] if len(parts) == 1 else parts[rank]
    if part == "auto":
        part = "cuda" if cuda_count else "cpu"
    if part == "cuda":
        if cuda_count < 1:
            raise ValueError("device cuda, but no CUDA device is visible")
        return f"cuda:{rank % cuda_count}"
    return part


class UserError(ValueError):
    """A mistake the person running ringserve can fix (a model that is not
    there, a malformed option, a port in use). The command line prints its
    message as one line and exits 2; the message says what to change."""


def json_object(text: str, what: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; ValueError naming `what` otherwise."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what} must be a JSON object")
    return raw


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
    # "auto": cuda where a GPU is visible, else cpu; "cuda": rank r on cuda:(r % GPUs);
    # or one device per rank, "cuda:0,cuda:0,cuda:1" (rank_device)
    device: str = "auto"
    wedge_timeout_s: float = 30.0
    heartbeat_s: float = 1.0
    layer_split: tuple[int, ...] | None = field(default=None)
    torch_threads: int | None = None
    passes_in_flight: int | None = None  # most passes in flight; default: ranks + 2 on a ring
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
    speculative: str | None = None  # None: off; "ngram": prompt lookup; "draft": a draft model
    num_speculative_tokens: int = 4  # the most tokens proposed per decode step
    ngram_max: int = 4  # prompt lookup matches the last ngram_max .. ngram_min tokens
    ngram_min: int = 2
    draft_model: Path | None = None
    speculative_adaptive: bool = True  # k per request follows its acceptance
    # CPU kernels: "native" reads the KV pool in place for decode attention and runs the
    # norms, rope and SwiGLU in one pass (kernels/cpu_native.py) where it builds, and packs
    # bfloat16 matmul weights (kernels/packed_linear.py); "torch" runs torch's ops throughout
    cpu_kernels: str = "native"
    # on a GPU, passes whose every row decodes one token replay CUDA graphs
    # (models/decode_graphs.py); True runs every pass op by op
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        self._check_speculative()
        device_list(self.device)
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(
                f"cpu_kernels must be one of {list(CPU_KERNELS)}, not {self.cpu_kernels!r}"
            )
        if self.plan_for not in PLAN_FOR:
            raise ValueError(f"plan_for must be one of {list(PLAN_FOR)}, not {self.plan_for!r}")
        if self.rank_speed is not None:
            speeds = tuple(float(s) for s in self.rank_speed)
            if not speeds or not all(0 < s < math.inf for s in speeds):
                raise ValueError(f"rank_speed must be positive finite factors, got {list(speeds)}")
            object.__setattr__(self, "rank_speed", speeds)  # a list given to LLM(...) too
        if self.min_kv_tokens is not None and self.min_kv_tokens < 2:
            raise ValueError("min_kv_tokens must be >= 2")
        if self.host_kv_tokens < 0:
            raise ValueError(f"host_kv_tokens must be >= 0, got {self.host_kv_tokens}")
        if self.host_kv_mib is not None and not 1 <= self.host_kv_mib <= MAX_MIB:
            raise ValueError(
                f"host_kv_mib must be 1 to {MAX_MIB} (16 TiB: a figure past it was not "
                f"written in MiB), got {self.host_kv_mib}"
            )
        if self.kv_capacity_tokens < 2:
            raise ValueError(f"kv_capacity_tokens must be >= 2, got {self.kv_capacity_tokens}")
        for name in ("wedge_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError("queue_timeout_s must be > 0 (leave it out for no timeout)")
        self._check_budgets()

    def _check_budgets(self) -> None:
        for name in ("max_tokens_per_pass", "chunk_size", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "passes_in_flight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (leave it out for the default), got {value}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")

    def _check_speculative(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {list(SPECULATIVE_METHODS)}, not {self.speculative!r}"
            )
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative 'draft' needs draft_model (a model directory)")
        if self.draft_model is not None and self.speculative != "draft":
            raise ValueError(
                "draft_model is used only with speculative 'draft' (--speculative draft)"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 1..16")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max")

    def ring_terms(self) -> bytes:
        """What every rank of one ring must have been given alike
        (`RING_FIELDS`) and the model's config.json (not its path, which may
        differ between machines). Per-rank choices (device, threads, kernels)
        and the plan's measured budgets are left out."""
        terms = {name: getattr(self, name) for name in RING_FIELDS}
        text = (self.model_dir / "config.json").read_text()
        try:  # its content, not its layout: a copy saved by another tool is the same model
            terms["model_config"] = json.loads(text)
        except ValueError:
            terms["model_config"] = text
        return json.dumps(terms, sort_keys=True).encode()

    def with_ring_of(self, sized: EngineConfig) -> EngineConfig:
        """This node's config on the ring `sized` (node 0's): its
        `RING_FIELDS`, plan and host tier taken, this node's per-rank
        choices kept."""
        taken = {name: getattr(sized, name) for name in RING_FIELDS}
        draft = sized.draft_model if sized.speculative == "draft" else None  # rank 0's alone
        return replace(
            self, **taken, draft_model=draft, plan=sized.plan, host_kv_mib=sized.host_kv_mib
        )

    @property
    def speculative_tokens(self) -> int:
        """The most speculative tokens a decode step carries; 0 when off."""
        return 0 if self.speculative is None else self.num_speculative_tokens

    @property
    def waiting_limit(self) -> int:
        """How many requests may wait for admission before more are refused."""
        if self.max_waiting_requests is not None:
            return self.max_waiting_requests
        return max(1, self.kv_capacity_tokens // KV_TOKENS_PER_WAITING)


def with_speculative_config(given: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """`given` options with those of vLLM's `speculative_config` form added;
    ValueError where both set one option to different values (which one
    was meant cannot be told)."""
    options = speculative_options(spec)
    for name, value in options.items():
        mine = given.get(name)
        if name == "draft_model" and mine is not None:
            mine = Path(mine)
        if mine is not None and mine != value:
            raise ValueError(
                f"speculative_config sets {name} to {str(value)!r}, and {name} is given as "
                f"{str(mine)!r}: give it once"
            )
    return {**given, **options}


def speculative_options(spec: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig options from vLLM's `speculative_config` form:
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2} (or "model" for a draft model)."""
    names = {
        "method": "speculative",
        "num_speculative_tokens": "num_speculative_tokens",
        "prompt_lookup_max": "ngram_max",
        "prompt_lookup_min": "ngram_min",
        "model": "draft_model",
    }
    unknown = sorted(set(spec) - set(names))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(names)}")
    kinds = {"method": str, "model": str}  # the rest are counts
    for key, value in spec.items():
        kind = kinds.get(key, int)
        if not isinstance(value, kind) or isinstance(value, bool):
            noun = "a string" if kind is str else "an integer"
            raise ValueError(f"speculative_config: {key} must be {noun}, got {value!r}")
    options = {names[k]: v for k, v in spec.items()}
    if options.get("speculative") == "draft_model":
        options["speculative"] = "draft"
    if "speculative" not in options:
        options["speculative"] = "draft" if "draft_model" in options else None
    if options.get("draft_model") is not None:
        options["draft_model"] = Path(options["draft_model"])
    if options["speculative"] is None:
        raise ValueError("speculative_config needs a method (ngram or draft) or a model")
    return options


def cache_dir() -> Path:
    """Where ringserve keeps what it makes once (the built-in model, the CPU
    kernels): `RINGSERVE_CACHE_DIR`, else `XDG_CACHE_HOME/ringserve`, else
    `~/.cache/ringserve`."""
    if os.environ.get("RINGSERVE_CACHE_DIR"):
        return Path(os.environ["RINGSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ringserve"
