"""Build one rank's slice of a model and fill it from the safetensors files,
reading only the tensors that slice holds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from ringserve.models import build_model
from ringserve.models.config import ModelConfig
from ringserve.models.slice import ModelSlice
from ringserve.models.weights import WeightIndex

log = structlog.get_logger(__name__)


class StageTensors(Mapping[str, torch.Tensor]):
    """A lazy mapping over exactly `names`: a tensor is read from its file
    when it is looked up, so loading keeps one source tensor in memory at a
    time. Use as a context manager; files open on first use. `read` lists
    the names actually read, in order; `on_read(nbytes)`, when given, is
    told the stored size of each tensor read."""

    def __init__(
        self,
        index: WeightIndex,
        names: list[str],
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        self._index = index
        self._on_read = on_read
        self._names = list(names)
        self._wanted = set(names)
        self._handles: dict[Path, Any] = {}
        self._stack = ExitStack()
        self.read: list[str] = []

    def __enter__(self) -> StageTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._wanted:
            raise KeyError(name)
        path = self._index[name].file
        handle = self._handles.get(path)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            self._handles[path] = handle
        self.read.append(name)
        tensor = handle.get_tensor(name)
        if self._on_read is not None:
            self._on_read(self._index[name].nbytes)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._wanted


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    layers: range,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    index: WeightIndex | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ModelSlice:
    """The model slice holding `layers`, its weights cast to `dtype` on
    `device`. Pass `index` to reuse one already read (the planner's), and
    `progress(read, total)` to hear the stored bytes read so far."""
    started = time.monotonic()
    if index is None:
        index = WeightIndex.from_dir(model_dir)
    names = index.stage_tensor_names(cfg, layers)
    model = build_model(cfg, layers, dtype, device)
    on_read = None
    if progress is not None:
        total, read = sum(index.nbytes(n) for n in names), 0

        def on_read(nbytes: int) -> None:
            nonlocal read
            read += nbytes
            progress(read, total)

    with StageTensors(index, names, on_read) as tensors:
        try:
            model.load_state(tensors)
        except ValueError as e:
            raise ValueError(f"{model_dir}: {e}") from e
    log.info(
        "model.load",
        model_type=cfg.model_type,
        layers=f"{layers.start}:{layers.stop}",
        tensors=len(names),
        bytes=index.stage_bytes(cfg, layers, dtype),
        seconds=round(time.monotonic() - started, 3),
    )
    return model.eval()
