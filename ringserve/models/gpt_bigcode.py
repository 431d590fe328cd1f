"""GPT-BigCode (StarCoder): multi-query attention through one fused c_attn
(q: hidden, then one head's k and one head's v; without multi-query, every
head's k and v, reordered so at load), learned position embeddings,
LayerNorm with bias, GELU MLP, head tied to the token embedding (or its own)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.cache.pool import KVPool
from ringserve.kernels import ops
from ringserve.kernels.batch import ForwardBatch
from ringserve.kernels.packed_linear import linear
from ringserve.models.config import GELU_APPROXIMATION, ModelConfig
from ringserve.models.slice import ModelSlice, empty_param

_HF_NAMES = {
    name.replace(".", "_"): name
    for name in (
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    )
}


class BigCodeLayer(nn.Module):
    """One pre-LayerNorm block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.kv_size
        p = {"dtype": dtype, "device": device}
        self.cfg = cfg
        self.scale = cfg.head_dim**-0.5 if cfg.raw.get("scale_attn_weights", True) else 1.0
        self.approximate = GELU_APPROXIMATION[cfg.activation]  # ModelConfig checked it
        self.params = nn.ParameterDict(
            {
                "ln_1_weight": empty_param(hidden, **p),
                "ln_1_bias": empty_param(hidden, **p),
                "attn_c_attn_weight": empty_param(hidden + 2 * kv, hidden, **p),
                "attn_c_attn_bias": empty_param(hidden + 2 * kv, **p),
                "attn_c_proj_weight": empty_param(hidden, hidden, **p),
                "attn_c_proj_bias": empty_param(hidden, **p),
                "ln_2_weight": empty_param(hidden, **p),
                "ln_2_bias": empty_param(hidden, **p),
                "mlp_c_fc_weight": empty_param(inter, hidden, **p),
                "mlp_c_fc_bias": empty_param(inter, **p),
                "mlp_c_proj_weight": empty_param(hidden, inter, **p),
                "mlp_c_proj_bias": empty_param(hidden, **p),
            }
        )

    def weight_slots(self, prefix: str) -> dict[str, torch.Tensor]:
        # Parameter names cannot hold dots: "attn.c_attn.weight" is kept as "attn_c_attn_weight".
        return {prefix + _HF_NAMES[key]: param for key, param in self.params.items()}

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        w, eps = self.params, self.cfg.norm_eps
        h = F.layer_norm(x, x.shape[-1:], w["ln_1_weight"], w["ln_1_bias"], eps)
        x = x + self.attention(h, batch, k_cache, v_cache)
        h = F.layer_norm(x, x.shape[-1:], w["ln_2_weight"], w["ln_2_bias"], eps)
        h = linear(h, w["mlp_c_fc_weight"], w["mlp_c_fc_bias"])
        h = F.gelu(h, approximate=self.approximate)
        return x + linear(h, w["mlp_c_proj_weight"], w["mlp_c_proj_bias"])

    def attention(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        cfg, w = self.cfg, self.params
        qkv = linear(x, w["attn_c_attn_weight"], w["attn_c_attn_bias"])
        q, k, v = qkv.split([cfg.hidden_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.unflatten(-1, (cfg.num_heads, cfg.head_dim))
        k = k.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        v = v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        ops.store_kv(k_cache, v_cache, batch.out_slots, k, v)
        out = ops.paged_attention(q, k_cache, v_cache, batch, self.scale)
        return linear(out.flatten(-2), w["attn_c_proj_weight"], w["attn_c_proj_bias"])


class GPTBigCodeModel(ModelSlice):
    """Layers `layers` of a GPT-BigCode model (see `ModelSlice`). The first
    stage owns wte and wpe; the last owns ln_f and the head: `lm_head` of an
    untied model; of a tied one wte itself when the stage is also first and
    a copy of it otherwise."""

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
        self.layers = nn.ModuleList(BigCodeLayer(cfg, dtype, device) for _ in layers)
        self.wte = empty_param(vocab, hidden, **p) if self.is_first else None
        self.wpe = empty_param(cfg.max_position_embeddings, hidden, **p) if self.is_first else None
        self.ln_f_weight = empty_param(hidden, **p) if self.is_last else None
        self.ln_f_bias = empty_param(hidden, **p) if self.is_last else None
        own_head = self.is_last and not (cfg.tie_word_embeddings and self.is_first)
        self.lm_head = empty_param(vocab, hidden, **p) if own_head else None

    def weight_slots(self) -> dict[str, torch.Tensor]:
        slots: dict[str, torch.Tensor] = {}
        for j, layer in enumerate(self.layers):
            slots.update(layer.weight_slots(f"transformer.h.{self.layer_range.start + j}."))
        if self.wte is not None:
            slots["transformer.wte.weight"] = self.wte
            slots["transformer.wpe.weight"] = self.wpe
        if self.ln_f_weight is not None:
            slots["transformer.ln_f.weight"] = self.ln_f_weight
            slots["transformer.ln_f.bias"] = self.ln_f_bias
        if self.lm_head is not None:
            tied = self.cfg.tie_word_embeddings
            slots["transformer.wte.weight" if tied else "lm_head.weight"] = self.lm_head
        return slots

    def head_weight(self) -> torch.Tensor:
        return self.wte if self.lm_head is None else self.lm_head

    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """As `ModelSlice.load_state`; without multi-query, c_attn's rows
        come per head (q, k, v of head 0, then of head 1, ...) and are put in
        the multi-query order the layers split (every head's q, then k, v)."""
        super().load_state(tensors)
        if self.cfg.num_kv_heads == 1:
            return
        cfg = self.cfg
        order = torch.arange(3 * cfg.hidden_size).view(cfg.num_heads, 3, cfg.head_dim)
        order = order.transpose(0, 1).reshape(-1)
        with torch.no_grad():
            for layer in self.layers:
                for name in ("attn_c_attn_weight", "attn_c_attn_bias"):
                    param = layer.params[name]
                    param.copy_(param[order.to(param.device)])

    def linear_weight_names(self) -> list[str]:
        names = [f"layers.{j}.params.{w}" for j in range(len(self.layers))
                 for w in ("attn_c_attn_weight", "attn_c_proj_weight", "mlp_c_fc_weight",
                           "mlp_c_proj_weight")]  # fmt: skip
        return names + (["lm_head"] if self.lm_head is not None else [])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """Token ids [T] (first stage) or residual stream [T, hidden] ->
        residual stream [T, hidden], after ln_f on the last stage."""
        self.check_pool(kv.num_layers)
        if self.wte is not None:
            x = F.embedding(x, self.wte) + F.embedding(batch.positions, self.wpe)
        for j, layer in enumerate(self.layers):
            x = layer(x, batch, kv.k[j], kv.v[j])
        if self.ln_f_weight is not None:
            eps = self.cfg.norm_eps
            x = F.layer_norm(x, x.shape[-1:], self.ln_f_weight, self.ln_f_bias, eps)
        return x
