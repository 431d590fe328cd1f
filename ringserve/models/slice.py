"""What every model family shares: a contiguous slice of the layers, and
loading its weights by their Hugging Face tensor names."""

from __future__ import annotations

from collections.abc import Mapping

import structlog
import torch
from torch import nn

from ringserve.kernels import packed_linear
from ringserve.models.config import ModelConfig

log = structlog.get_logger(__name__)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised inference weight: `load_state` fills it, so paying for
    a random init of billions of values would be waste."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def check_layer_range(cfg: ModelConfig, layers: range) -> None:
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= cfg.num_layers:
        raise ValueError(
            f"layer range {layers} is not a non-empty contiguous slice of the "
            f"model's {cfg.num_layers} layers"
        )


class ModelSlice(nn.Module):
    """Layers `layer_range` of a model. Invariant: the first stage
    (start == 0) owns the token embedding, the last stage (stop ==
    num_layers) owns the final norm and the head matrix, and local layer j
    is global layer start + j, using KV pool layer j.

    Weights are uninitialised until `load_state` has filled every one of them.
    Subclasses say where each Hugging Face tensor goes in `weight_slots`.
    """

    def __init__(self, cfg: ModelConfig, layers: range, dtype: torch.dtype) -> None:
        super().__init__()
        check_layer_range(cfg, layers)
        self.cfg = cfg
        self.layer_range = layers
        self.dtype = dtype

    @property
    def is_first(self) -> bool:
        return self.layer_range.start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_range.stop == self.cfg.num_layers

    def weight_slots(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> the tensor (or view into a fused one)
        it is copied into."""
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def linear_weight_names(self) -> list[str]:
        """Dotted names of the parameters used as matmul weights alone (a
        head that is the embedding too is not one of them)."""
        raise NotImplementedError

    def pack_linear_weights(self) -> int:
        """Put every matmul weight that `packed_linear` can pack in oneDNN's
        layout, in place of the plain one; returns how many it packed. Call
        once the weights are loaded."""
        packed = 0
        for name in self.linear_weight_names():
            owner_name, _, attr = name.rpartition(".")
            owner = self.get_submodule(owner_name) if owner_name else self
            weight = getattr(owner, attr)
            if not packed_linear.can_pack(weight):
                continue
            try:
                done = packed_linear.pack(weight)
            except RuntimeError as exc:  # this oneDNN cannot: the rest stay plain too
                log.info("weights.plain", reason=str(exc).splitlines()[0][:200])
                return packed
            setattr(owner, attr, nn.Parameter(done, requires_grad=False))
            packed += 1
        return packed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] final-normed states -> [S, vocab] float32 logits."""
        if not self.is_last:
            raise RuntimeError(f"layers {self.layer_range} are not the last stage: no head")
        return packed_linear.linear(hidden, self.head_weight()).float()

    def check_pool(self, num_pool_layers: int) -> None:
        if num_pool_layers != len(self.layer_range):
            raise ValueError(
                f"KV pool has {num_pool_layers} layers, stage {self.layer_range} needs "
                f"{len(self.layer_range)}"
            )

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy (and cast) every tensor into place. Raises, naming them, when
        any tensor the slice needs is missing, any given one is not the
        slice's, or a shape differs. Values are fetched one at a time, so a
        lazy mapping keeps only one source tensor in memory."""
        slots = self.weight_slots()
        missing = sorted(slots.keys() - tensors.keys())
        unexpected = sorted(tensors.keys() - slots.keys())
        if missing or unexpected:
            raise ValueError(
                f"weights do not match {self.cfg.model_type} layers {self.layer_range}: "
                f"missing {_names(missing)}, unexpected {_names(unexpected)}"
            )
        for name, dest in slots.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(dest.shape):
                raise ValueError(
                    f"tensor {name} has shape {tuple(src.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(src)


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:8])
    return f"{shown} (+{len(names) - 8} more)" if len(names) > 8 else shown
