"""What a model directory's weights are, from safetensors headers alone.

`WeightIndex` reads only each file's 8-byte header length and JSON header (no
tensor data), so the memory planner can size every rank before anything is
loaded. `part_of` is the one definition of which part of the model a tensor
belongs to; the loader and the planner both go through it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch

from ringserve.models.config import ModelConfig
from ringserve.models.slice import check_layer_range

Part = int | Literal["embed", "head"]

_MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors format itself sets
_LAYER = {
    "llama": re.compile(r"model\.layers\.(\d+)\."),
    "gpt_bigcode": re.compile(r"transformer\.h\.(\d+)\."),
}
_EMBED = {
    "llama": ("model.embed_tokens.",),
    "gpt_bigcode": ("transformer.wte.", "transformer.wpe."),
}
_HEAD = {"llama": ("model.norm.", "lm_head."), "gpt_bigcode": ("transformer.ln_f.", "lm_head.")}
_EMBEDDING_MATRIX = {"llama": "model.embed_tokens.weight", "gpt_bigcode": "transformer.wte.weight"}
# Buffers some checkpoints carry that the models recompute.
_RECOMPUTED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives and how big it is, as its file header says."""

    file: Path
    dtype: str  # safetensors spelling: "F32", "BF16", ...
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class PartBytes(NamedTuple):
    """Weight bytes by part. With tied embeddings `head` includes a copy of
    the embedding matrix, which a last stage that is not also the first must
    hold; a single stage holds it once (see `WeightIndex.stage_bytes`)."""

    embed: int
    layers: list[int]
    head: int


def part_of(cfg: ModelConfig, name: str) -> Part:
    """Layer index, "embed" (token and position embeddings) or "head" (final
    norm and lm_head) for a Hugging Face tensor name of `cfg`'s family."""
    family = cfg.family
    if name.startswith(_EMBED[family]):
        return "embed"
    if name.startswith(_HEAD[family]):
        return "head"
    match = _LAYER[family].match(name)
    if match is None:
        raise ValueError(f"tensor {name!r} belongs to no part of a {cfg.model_type} model")
    layer = int(match.group(1))
    if layer >= cfg.num_layers:
        raise ValueError(f"tensor {name!r} is for layer {layer}; the model has {cfg.num_layers}")
    return layer


def embedding_matrix_name(cfg: ModelConfig) -> str:
    return _EMBEDDING_MATRIX[cfg.family]


def is_unread(cfg: ModelConfig, name: str) -> bool:
    """Tensors present in some checkpoints that no stage loads: recomputed
    buffers, and lm_head.weight of a tied model (the head is the embedding)."""
    if name.endswith(_RECOMPUTED_SUFFIXES):
        return True
    return cfg.tie_word_embeddings and name.startswith("lm_head.")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo from one safetensors file's header only."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than 8 bytes")
        length = int.from_bytes(prefix, "little")
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header claims {length} bytes, over the limit")
        raw = f.read(length)
    if len(raw) != length:
        raise ValueError(f"{path}: safetensors header truncated ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{path}: safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    try:
        tensors = {
            name: TensorInfo(
                path, e["dtype"], tuple(e["shape"]), e["data_offsets"][1] - e["data_offsets"][0]
            )
            for name, e in header.items()
        }
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: a safetensors header entry is malformed ({e!r})") from None
    size = path.stat().st_size
    if 8 + length + end > size:  # a copy cut short: found here, not by a rank's loader
        raise ValueError(
            f"{path} is truncated: its header places tensors up to byte {8 + length + end}, "
            f"the file has {size}"
        )
    return tensors


class WeightIndex:
    """Every tensor of a model directory: name -> TensorInfo. Invariant: each
    name appears in exactly one file."""

    def __init__(self, model_dir: Path, tensors: dict[str, TensorInfo]) -> None:
        self.model_dir = model_dir
        self.tensors = tensors

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> WeightIndex:
        model_dir = Path(model_dir)
        tensors: dict[str, TensorInfo] = {}
        for path in _weight_files(model_dir):
            for name, info in read_header(path).items():
                if name in tensors:
                    raise ValueError(
                        f"tensor {name} is in both {tensors[name].file.name} and {path.name}"
                    )
                tensors[name] = info
        _check_index_map(model_dir, tensors)
        return cls(model_dir, tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def stage_tensor_names(self, cfg: ModelConfig, layers: range) -> list[str]:
        """The tensors a stage holding `layers` reads, and no other."""
        check_layer_range(cfg, layers)
        first, last = layers.start == 0, layers.stop == cfg.num_layers
        names = []
        for name in self.tensors:
            if is_unread(cfg, name):
                continue
            part = part_of(cfg, name)
            if part == "embed":
                wanted = first
            elif part == "head":
                wanted = last
            else:
                wanted = part in layers
            if wanted:
                names.append(name)
        tied_copy = embedding_matrix_name(cfg)
        if last and not first and cfg.tie_word_embeddings and tied_copy in self.tensors:
            names.append(tied_copy)
        return sorted(names)

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        """Bytes of one tensor as stored, or once cast to `dtype`."""
        info = self.tensors[name]
        return info.nbytes if dtype is None else info.numel * dtype.itemsize

    def stage_bytes(self, cfg: ModelConfig, layers: range, dtype: torch.dtype | None = None) -> int:
        """Exact weight bytes the stage holding `layers` loads."""
        return sum(self.nbytes(n, dtype) for n in self.stage_tensor_names(cfg, layers))

    def bytes_by_part(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> PartBytes:
        embed, head, layers = 0, 0, [0] * cfg.num_layers
        for name in self.tensors:
            if is_unread(cfg, name):
                continue
            part = part_of(cfg, name)
            size = self.nbytes(name, dtype)
            if part == "embed":
                embed += size
            elif part == "head":
                head += size
            else:
                layers[part] += size
        tied_copy = embedding_matrix_name(cfg)
        if cfg.tie_word_embeddings and tied_copy in self.tensors:
            head += self.nbytes(tied_copy, dtype)
        return PartBytes(embed, layers, head)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index.name} lists shard {f.name}, which is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return files


def _check_index_map(model_dir: Path, tensors: dict[str, TensorInfo]) -> None:
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return
    for name, shard in json.loads(index.read_text())["weight_map"].items():
        info = tensors.get(name)
        if info is None or info.file.name != shard:
            raise ValueError(f"{index.name} places {name} in {shard}, whose header lacks it")
