"""What the planner knows about a model's bytes: the embeddings, each decoder
layer, the head and KV per token per layer, from the config's parameter
counts or from the safetensors headers (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from ringserve.models.config import _DTYPE_BYTES, ModelConfig
from ringserve.plan.ledger import Figure


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What the solve needs to know about a model. `tied` is the part of
    `head` that is the embedding matrix itself (tied embeddings): the last
    rank holds its own copy, but one rank holding both stores it once."""

    embed: Figure
    layers: tuple[Figure, ...]
    head: Figure
    kv_per_token_per_layer: Figure
    tied: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one decoder layer")
        if self.kv_per_token_per_layer.bytes <= 0:
            raise ValueError("KV bytes per token per layer must be positive")
        if not 0 <= self.tied <= min(self.embed.bytes, self.head.bytes):
            raise ValueError(f"tied bytes {self.tied} exceed the embedding or the head")

    @property
    def head_layers(self) -> Fraction:
        """The head's time per pass in layer times, exactly: its weight
        bytes over a mean layer's. A decode pass streams every weight once,
        so its matmuls take time in proportion to their bytes; a 150k-token
        vocabulary's head outweighs several layers. 0 for weightless layers."""
        layer_bytes = sum(f.bytes for f in self.layers)
        if layer_bytes == 0:
            return Fraction(0)
        return Fraction(self.head.bytes * len(self.layers), layer_bytes)


def model_bytes_from_config(cfg: ModelConfig, dtype: str) -> ModelBytes:
    """Weight bytes from the config's parameter counts, all source "config"."""
    elem = _DTYPE_BYTES[dtype]
    embed, layer, head, tied = _param_counts(cfg)
    return ModelBytes(
        embed=Figure(embed * elem, "config"),
        layers=(Figure(layer * elem, "config"),) * cfg.num_layers,
        head=Figure(head * elem, "config"),
        kv_per_token_per_layer=Figure(cfg.kv_bytes_per_token_per_layer(dtype), "config"),
        tied=tied * elem,
    )


_O_PROJ_BIAS = {"llama", "qwen3"}  # Qwen2 biases q, k, v but not o


def _param_counts(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(embed, one decoder layer, head, tied) parameter counts, as the
    Hugging Face modules of each family lay them out."""
    if cfg.family == "gpt_bigcode":
        return _bigcode_counts(cfg)
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    attn = 2 * h * q + 2 * h * kv
    if cfg.attention_bias:
        attn += q + 2 * kv + (h if cfg.model_type in _O_PROJ_BIAS else 0)
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    layer = attn + 3 * h * cfg.intermediate_size + 2 * h  # gate, up, down; two RMSNorms
    vocab = cfg.vocab_size * h
    return vocab, layer, h + vocab, vocab if cfg.tie_word_embeddings else 0


def _bigcode_counts(cfg: ModelConfig) -> tuple[int, int, int, int]:
    h, inner = cfg.hidden_size, cfg.intermediate_size
    qkv = h + 2 * cfg.kv_size  # multi-query: one K and one V head
    layer = (h + 1) * qkv + (h + 1) * h + (h + 1) * inner + (inner + 1) * h + 4 * h
    vocab = cfg.vocab_size * h
    embed = vocab + cfg.max_position_embeddings * h  # token and learned position tables
    return embed, layer, 2 * h + vocab, vocab if cfg.tie_word_embeddings else 0


def model_bytes_from_dir(model_dir: str | Path, cfg: ModelConfig, dtype: str) -> ModelBytes:
    """Weight bytes from the safetensors headers (source "file"), nothing
    loaded. Weights are served in `dtype`, so each tensor counts its element
    count times the bytes of `dtype`, whatever dtype the file stores it in.
    With tied embeddings `head` holds the embedding matrix's copy and `tied`
    its size, as `WeightIndex.stage_bytes` counts a stage's tensors."""
    import torch

    from ringserve.models.weights import WeightIndex, embedding_matrix_name

    index, serving = WeightIndex.from_dir(model_dir), getattr(torch, dtype)
    parts = index.bytes_by_part(cfg, serving)
    matrix = embedding_matrix_name(cfg)
    tied = index.nbytes(matrix, serving) if cfg.tie_word_embeddings and matrix in index else 0
    return ModelBytes(
        embed=Figure(parts.embed, "file"),
        layers=tuple(Figure(n, "file") for n in parts.layers),
        head=Figure(parts.head, "file"),
        kv_per_token_per_layer=Figure(cfg.kv_bytes_per_token_per_layer(dtype), "config"),
        tied=tied,
    )
