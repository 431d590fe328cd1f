"""Rotary position embedding (RoPE) of the Llama family.

The inverse frequencies are computed once per model, with Llama-3 style
frequency scaling applied when the config asks for it; cos/sin are computed
once per forward from the pass's positions and shared by every layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ringserve.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, as transformers computes
    them (default RoPE, or `_compute_llama3_parameters` for rope_type llama3)."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is None:
        return inv_freq
    return _llama3_scaled(inv_freq, cfg.rope_scaling)


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


class RotaryEmbedding(nn.Module):
    """Holds the model's inverse frequencies (a non-persistent buffer, so it
    follows the module's device); `cos_sin` turns positions into the
    [T, 1, head_dim] tables `apply_rope` broadcasts over heads."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin): the sine's first half is negated, so that
        `apply_rope` rotates with one roll instead of a negation and a cat."""
        # Angles in float32 whatever the model dtype, then cast, as the reference does.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : freqs.shape[1]].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] queries or keys (or both, stacked along H) by the
    "rotate half" convention of Hugging Face checkpoints (first half of each
    head pairs with the second): x * cos + cat(-x2, x1) * sin, where
    roll(x, D/2) is cat(x2, x1) and the sign sits in `signed_sin`."""
    out = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return out.addcmul_(x, cos)
