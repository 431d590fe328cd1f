"""Rotary position embedding (RoPE) of the Llama family.

The inverse frequencies are computed once per model, with the frequency
scaling the config asks for (`llama3`, `linear` or `yarn`, as transformers
computes them; YaRN also scales cos and sin); cos/sin are computed once per
forward from the pass's positions and shared by every layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ringserve.models.config import ModelConfig


def rope_parameters(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """[head_dim / 2] float32 inverse frequencies and the factor cos and
    sin are scaled by, as transformers computes them for the config's
    rope_type (default, llama3, linear or yarn)."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling), 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    return _yarn(cfg, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Long wavelengths (beyond the original context) are slowed by `factor`,
    # short ones kept, and the band between them interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn many times within the pretrained context
    keep their frequency, those that turn less than once are interpolated by
    `factor`, a linear ramp between; cos and sin grow with log(factor)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    pretrained = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = cfg.max_position_embeddings / pretrained if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(pretrained / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # the share of each dimension's own frequency
    inv_freq = (1.0 / (factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """Holds the model's inverse frequencies (a non-persistent buffer, so it
    follows the module's device); `cos_sin` turns positions into the
    [T, 1, head_dim] tables `apply_rope` broadcasts over heads."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        inv_freq, self.scale = rope_parameters(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin): the sine's first half is negated, so that
        `apply_rope` rotates with one roll instead of a negation and a cat."""
        # Angles in float32 whatever the model dtype, then cast, as the reference does.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:  # YaRN's attention factor
            cos, sin = cos * self.scale, sin * self.scale
        sin[:, : freqs.shape[1]].neg_()
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] queries or keys (or both, stacked along H) by the
    "rotate half" convention of Hugging Face checkpoints (first half of each
    head pairs with the second): x * cos + cat(-x2, x1) * sin, where
    roll(x, D/2) is cat(x2, x1) and the sign sits in `signed_sin`."""
    out = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return out.addcmul_(x, cos)
