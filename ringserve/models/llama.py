"""The Llama family (Llama, Mistral, Qwen2, Qwen3): RMSNorm, RoPE, GQA,
SwiGLU. Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k before
RoPE.

q/k/v and gate/up projections are each fused into one matrix at load time
(one matmul instead of three or two); the Hugging Face tensors are copied into
row blocks of the fused weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.cache.pool import KVPool
from ringserve.kernels import ops
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.cpu_native import CpuKernels
from ringserve.kernels.native_pass import NativePass
from ringserve.kernels.packed_linear import linear
from ringserve.models.config import ModelConfig
from ringserve.models.rope import RotaryEmbedding, apply_rope
from ringserve.models.slice import ModelSlice, empty_param


class LlamaLayer(nn.Module):
    """One decoder layer. `forward` takes the residual stream and the
    not-yet-added output of the previous layer's MLP (None for the first
    layer of a stage), so that addition fuses with this layer's input norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        p = {"dtype": dtype, "device": device}
        self.cfg = cfg
        self.scale = cfg.head_dim**-0.5
        self.input_norm = empty_param(hidden, **p)
        self.post_norm = empty_param(hidden, **p)
        self.qkv = empty_param(q + 2 * kv, hidden, **p)
        self.qkv_bias = empty_param(q + 2 * kv, **p) if cfg.attention_bias else None
        self.o = empty_param(hidden, q, **p)
        self.o_bias = empty_param(hidden, **p) if _o_bias(cfg) else None
        self.q_norm = empty_param(cfg.head_dim, **p) if cfg.qk_norm else None
        self.k_norm = empty_param(cfg.head_dim, **p) if cfg.qk_norm else None
        self.gate_up = empty_param(2 * inter, hidden, **p)
        self.down = empty_param(hidden, inter, **p)
        self.mlp_bias = _mlp_bias(cfg)
        self.gate_up_bias = empty_param(2 * inter, **p) if self.mlp_bias else None
        self.down_bias = empty_param(hidden, **p) if self.mlp_bias else None

    def weight_slots(self, prefix: str) -> dict[str, torch.Tensor]:
        q, kv, inter = self.cfg.q_size, self.cfg.kv_size, self.cfg.intermediate_size
        attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
        slots = {
            f"{prefix}input_layernorm.weight": self.input_norm,
            f"{prefix}post_attention_layernorm.weight": self.post_norm,
            f"{attn}o_proj.weight": self.o,
            f"{mlp}down_proj.weight": self.down,
        }
        for name, rows in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, None))):
            slots[f"{attn}{name}.weight"] = self.qkv[rows[0] : rows[1]]
            if self.qkv_bias is not None:
                slots[f"{attn}{name}.bias"] = self.qkv_bias[rows[0] : rows[1]]
        for name, rows in (("gate_proj", (0, inter)), ("up_proj", (inter, None))):
            slots[f"{mlp}{name}.weight"] = self.gate_up[rows[0] : rows[1]]
            if self.gate_up_bias is not None:
                slots[f"{mlp}{name}.bias"] = self.gate_up_bias[rows[0] : rows[1]]
        if self.o_bias is not None:
            slots[f"{attn}o_proj.bias"] = self.o_bias
        if self.down_bias is not None:
            slots[f"{mlp}down_proj.bias"] = self.down_bias
        if self.q_norm is not None:
            slots[f"{attn}q_norm.weight"] = self.q_norm
            slots[f"{attn}k_norm.weight"] = self.k_norm
        return slots

    def forward(
        self,
        residual: torch.Tensor,
        pending: torch.Tensor | None,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (residual stream after attention, MLP output to add)."""
        eps = self.cfg.norm_eps
        native = batch.native
        if pending is None:
            normed = ops.rmsnorm(residual, self.input_norm, eps, native)
        else:
            normed, residual = ops.add_rmsnorm(pending, residual, self.input_norm, eps, native)
        attn = self.attention(normed, batch, k_cache, v_cache, rope)
        normed, residual = ops.add_rmsnorm(attn, residual, self.post_norm, eps, native)
        return residual, self.mlp(normed, native)

    def attention(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        cfg = self.cfg
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        heads = linear(x, self.qkv, self.qkv_bias).unflatten(-1, (hq + 2 * hkv, cfg.head_dim))
        qk, v = heads.split([hq + hkv, hkv], dim=1)
        if self.q_norm is not None:
            qk = self._norm_qk(qk)
        native = batch.native
        if native is not None and native.supports_rope_store(qk, v, rope[0], k_cache, v_cache):
            q = native.rope_store(qk, v, *rope, k_cache, v_cache, batch.out_slots)
        else:
            # q and k are rotated together: one rope over [T, Hq + Hkv, D].
            q, k = apply_rope(qk, *rope).split([hq, hkv], dim=1)
            ops.store_kv(k_cache, v_cache, batch.out_slots, k, v)
        out = ops.paged_attention(q, k_cache, v_cache, batch, self.scale)
        return linear(out.flatten(-2), self.o, self.o_bias)

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head norms of [T, Hq + Hkv, D] queries and keys (one
        expression: the normed halves die with the cat)."""
        hq, eps = self.cfg.num_heads, self.cfg.norm_eps
        return torch.cat(
            (ops.rmsnorm(qk[:, :hq], self.q_norm, eps), ops.rmsnorm(qk[:, hq:], self.k_norm, eps)),
            dim=1,
        )

    def mlp(self, x: torch.Tensor, native: CpuKernels | None = None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up, self.gate_up_bias)
        return linear(ops.silu_mul(gate_up, native), self.down, self.down_bias)

    def forward_native(
        self,
        residual: torch.Tensor,
        pending: torch.Tensor | None,
        kernels: NativePass,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on a pass the CPU kernels take whole (`NativePass`):
        the same ops, without asking each one which backend runs it."""
        cfg = self.cfg
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        if pending is None:
            normed = kernels.rmsnorm(residual, self.input_norm)
        else:
            normed, residual = kernels.add_rmsnorm(pending, residual, self.input_norm)
        heads = linear(normed, self.qkv, self.qkv_bias).unflatten(-1, (hq + 2 * hkv, -1))
        qk, v = heads[:, : hq + hkv], heads[:, hq + hkv :]
        if self.q_norm is not None:
            qk = self._norm_qk(qk)
        q = kernels.rope_store(qk, v, k_cache, v_cache)
        out = kernels.attention(q, k_cache, v_cache, self.scale)
        attn = linear(out.flatten(-2), self.o, self.o_bias)
        normed, residual = kernels.add_rmsnorm(attn, residual, self.post_norm)
        gate_up = linear(normed, self.gate_up, self.gate_up_bias)
        return residual, linear(kernels.silu_mul(gate_up), self.down, self.down_bias)


class LlamaModel(ModelSlice):
    """Layers `layers` of a Llama-family model (see `ModelSlice`). With tied
    embeddings the head is the embedding matrix: the same tensor when one
    stage is both first and last, a separate copy on a last stage that is not
    the first."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(cfg, layers, dtype)
        p = {"dtype": dtype, "device": device}
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        self.rotary = RotaryEmbedding(cfg, device)
        self.layers = nn.ModuleList(LlamaLayer(cfg, dtype, device) for _ in layers)
        self.embed = empty_param(vocab, hidden, **p) if self.is_first else None
        self.norm = empty_param(hidden, **p) if self.is_last else None
        own_head = self.is_last and not (cfg.tie_word_embeddings and self.is_first)
        self.lm_head = empty_param(vocab, hidden, **p) if own_head else None

    def weight_slots(self) -> dict[str, torch.Tensor]:
        slots: dict[str, torch.Tensor] = {}
        for j, layer in enumerate(self.layers):
            slots.update(layer.weight_slots(f"model.layers.{self.layer_range.start + j}."))
        if self.embed is not None:
            slots["model.embed_tokens.weight"] = self.embed
        if self.norm is not None:
            slots["model.norm.weight"] = self.norm
        if self.lm_head is not None:
            tied = self.cfg.tie_word_embeddings
            slots["model.embed_tokens.weight" if tied else "lm_head.weight"] = self.lm_head
        return slots

    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def linear_weight_names(self) -> list[str]:
        names = [f"layers.{j}.{w}" for j in range(len(self.layers))
                 for w in ("qkv", "o", "gate_up", "down")]  # fmt: skip
        return names + (["lm_head"] if self.lm_head is not None else [])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """Token ids [T] (first stage) or residual stream [T, hidden] ->
        residual stream [T, hidden], final-normed on the last stage."""
        self.check_pool(kv.num_layers)
        h = F.embedding(x, self.embed) if self.embed is not None else x
        rope = self.rotary.cos_sin(batch.positions, h.dtype)
        kernels = self._native_pass(batch, h, rope, kv)
        pending = None
        if kernels is not None:
            for j, layer in enumerate(self.layers):
                h, pending = layer.forward_native(h, pending, kernels, kv.k[j], kv.v[j])
        else:
            for j, layer in enumerate(self.layers):
                h, pending = layer(h, pending, batch, kv.k[j], kv.v[j], rope)
        if self.norm is None:
            return h + pending
        if kernels is not None:
            return kernels.add_rmsnorm(pending, h, self.norm)[0]
        return ops.add_rmsnorm(pending, h, self.norm, self.cfg.norm_eps, batch.native)[0]

    def _native_pass(
        self, batch: ForwardBatch, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        kv: KVPool,
    ) -> NativePass | None:  # fmt: skip
        """The pass bound to the CPU kernels, where it has them and they
        take every layer's rows (a stage without layers has nothing to bind)."""
        cfg = self.cfg
        if batch.native is None or not self.layers or h.dtype != self.dtype:
            return None
        if h.dim() != 2 or h.shape[1] != cfg.hidden_size:
            return None
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return NativePass.bind(batch.native, batch, h, rope, kv.k[0], heads, cfg.norm_eps)


def _o_bias(cfg: ModelConfig) -> bool:
    # Qwen2 biases q, k and v only; Llama's attention_bias covers o_proj too.
    return cfg.attention_bias and cfg.model_type != "qwen2"


def _mlp_bias(cfg: ModelConfig) -> bool:
    return bool(cfg.raw.get("mlp_bias", False))
