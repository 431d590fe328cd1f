"""Model families and their construction for one rank's slice of layers."""

from __future__ import annotations

import torch

from ringserve.models.config import ModelConfig
from ringserve.models.gpt_bigcode import GPTBigCodeModel
from ringserve.models.llama import LlamaModel
from ringserve.models.slice import ModelSlice

__all__ = ["GPTBigCodeModel", "LlamaModel", "ModelConfig", "ModelSlice", "build_model"]


def build_model(
    cfg: ModelConfig,
    layers: range,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> ModelSlice:
    """An unloaded model holding `layers` of `cfg`; fill it with `load_state`
    (or build and fill it in one step with `loader.load_model`)."""
    if cfg.family == "gpt_bigcode":
        return GPTBigCodeModel(cfg, layers, dtype, device)
    return LlamaModel(cfg, layers, dtype, device)
