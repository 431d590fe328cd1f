"""Model configuration parsed from a Hugging Face `config.json`.

One frozen dataclass covers both families ringserve runs: the Llama family
(Llama, Mistral, Qwen2, Qwen3) and GPT-BigCode. Everything the loader, the
runner and the memory planner derive from the config lives here as a property,
so there is one definition of each figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}
BIGCODE_FAMILY = {"gpt_bigcode"}

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ROPE_SCALINGS = ("llama3", "linear", "yarn")  # the rope_type values served (models/rope.py)
SILU_ACTIVATIONS = frozenset({"silu", "swish"})  # the Llama family's MLP (models/llama.py)
# GPT-BigCode's activation_function -> torch's gelu approximation (models/gpt_bigcode.py)
GELU_APPROXIMATION = {
    "gelu": "none",
    "gelu_pytorch_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of one model; validated at construction."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    activation: str = "silu"  # `hidden_act`, or GPT-BigCode's `activation_function`
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in LLAMA_FAMILY | BIGCODE_FAMILY:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}: ringserve runs "
                f"{sorted(LLAMA_FAMILY | BIGCODE_FAMILY)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if min(self.num_layers, self.hidden_size, self.vocab_size, self.head_dim) <= 0:
            raise ValueError("config has a non-positive size")
        if self.family == "llama" and self.activation not in SILU_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.activation!r} is not supported (the Llama family uses silu)"
            )
        if self.family == "gpt_bigcode" and self.activation not in GELU_APPROXIMATION:
            raise ValueError(
                f"activation_function {self.activation!r} is not supported by gpt_bigcode "
                f"(only {', '.join(GELU_APPROXIMATION)})"
            )

    @property
    def family(self) -> str:
        return "gpt_bigcode" if self.model_type in BIGCODE_FAMILY else "llama"

    @property
    def context_limit(self) -> int:
        """The longest context served: the model's positions, and no longer
        than a sliding window any layer applies, since ringserve's attention
        reads every position of the context (within the window both agree)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token_per_layer(self, dtype: str) -> int:
        """Bytes one token's K and V take in one layer of the KV pool."""
        return 2 * self.kv_size * _DTYPE_BYTES[dtype]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type in BIGCODE_FAMILY:
            return cls._from_bigcode(cfg)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=float(_rope_theta(cfg)),
            rope_scaling=_rope_scaling(cfg),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window(cfg, model_type),
            eos_token_ids=_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            activation=cfg.get("hidden_act", "silu"),
            raw=cfg,
        )

    @classmethod
    def _from_bigcode(cls, cfg: dict[str, Any]) -> ModelConfig:
        hidden = cfg["n_embd"]
        heads = cfg["n_head"]
        return cls(
            model_type="gpt_bigcode",
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["n_layer"],
            num_heads=heads,
            num_kv_heads=1 if cfg.get("multi_query", True) else heads,
            head_dim=hidden // heads,
            intermediate_size=cfg.get("n_inner") or 4 * hidden,
            max_position_embeddings=cfg.get("n_positions", 2048),
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            eos_token_ids=_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            activation=cfg.get("activation_function", "gelu_pytorch_tanh"),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs config.json")
        raw = _json_object(path)
        try:
            cfg = cls.from_dict(raw)
        except KeyError as exc:
            kind = raw.get("model_type") or "model"
            raise ValueError(
                f"{path} has no {exc.args[0]!r}, which a {kind} config needs"
            ) from None
        except TypeError as exc:
            raise ValueError(f"{path}: a field has the wrong type ({exc})") from None
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            extra = _ids(_json_object(gen).get("eos_token_id"))
            merged = tuple(dict.fromkeys(cfg.eos_token_ids + extra))
            cfg = _replace(cfg, eos_token_ids=merged)
        return cfg


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; ValueError naming the file otherwise."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


def _replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The window of the layers that attend to a sliding window, as
    transformers reads the config, or None when no layer does: every layer
    of a Mistral with `sliding_window`; a Qwen2 or Qwen3 only with
    `use_sliding_window`, on the layers `layer_types` names (without it,
    those from `max_window_layers` on)."""
    window = cfg.get("sliding_window")
    if not window or model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    types = cfg.get("layer_types")
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    if model_type in ("qwen2", "qwen3"):
        below = cfg.get("max_window_layers", 28)
        return int(window) if below < cfg["num_hidden_layers"] else None
    return int(window)


def _rope_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters as transformers 5 reads them: the legacy
    `rope_scaling` where given, else `rope_parameters`."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    """The rope dict's `rope_theta` first, then the top-level one (as
    transformers' `convert_rope_params_to_dict` ranks them)."""
    return _rope_dict(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0))


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = _rope_dict(cfg)
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALINGS:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported (only {', '.join(ROPE_SCALINGS)})"
        )
    out = {**scaling, "rope_type": kind}
    if kind in ("llama3", "yarn"):  # the pretrained context, where transformers finds it first
        pretrained = cfg.get("original_max_position_embeddings")
        if pretrained is None:
            pretrained = scaling.get("original_max_position_embeddings")
        out["original_max_position_embeddings"] = pretrained or cfg.get("max_position_embeddings")
    return out
