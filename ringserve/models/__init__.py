"""Model families and their construction for one rank's slice of layers.

The families are resolved on first use: the tokenizer, the config and the
Hub are read without loading torch (`ringserve bench` needs only those)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ringserve.models.config import ModelConfig
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
        from ringserve.models.gpt_bigcode import GPTBigCodeModel

        return GPTBigCodeModel(cfg, layers, dtype, device)
    from ringserve.models.llama import LlamaModel

    return LlamaModel(cfg, layers, dtype, device)


_WHERE = {
    "GPTBigCodeModel": "ringserve.models.gpt_bigcode",
    "LlamaModel": "ringserve.models.llama",
    "ModelConfig": "ringserve.models.config",
    "ModelSlice": "ringserve.models.slice",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'ringserve.models' has no attribute {name!r}")
