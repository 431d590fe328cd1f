"""Weight index from safetensors headers, the part each tensor belongs to,
and loading only a stage's own tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from ringserve.models import build_model, loader
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model
from ringserve.models.weights import WeightIndex, part_of
from tests import model_factory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_factory.llama_gqa(tmp_path_factory.mktemp("loader"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_factory.qwen2_tied(tmp_path_factory.mktemp("loader"))


@pytest.fixture(scope="module")
def bigcode_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_factory.bigcode_mqa(tmp_path_factory.mktemp("loader"))


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(file name, tensor name) of every tensor the loader reads, through the
    real safe_open."""
    seen: list[tuple[str, str]] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, path: str, **kwargs: object) -> None:
            self._path, self._cm = Path(path), real(path, **kwargs)

        def __enter__(self) -> Recording:
            self._handle = self._cm.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._cm.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            seen.append((self._path.name, name))
            return self._handle.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    return seen


def test_sharded_index_lists_every_tensor_with_its_file_and_size(llama_dir: Path) -> None:
    index = WeightIndex.from_dir(llama_dir)
    shards = json.loads((llama_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1
    assert set(index.tensors) == set(shards)
    for name, shard in shards.items():
        tensor = load_file(llama_dir / shard)[name]
        info = index[name]
        assert info.file.name == shard
        assert (info.shape, info.dtype) == (tuple(tensor.shape), "F32")
        assert info.nbytes == tensor.numel() * tensor.element_size()


def test_index_reads_headers_only_and_refuses_a_cut_file(llama_dir: Path, tmp_path: Path) -> None:
    # Every shard's data a hole of its size (zeros, never written): the
    # headers say it all. Cut right after the header, a shard is refused.
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        d.mkdir()
        shutil.copy(llama_dir / "model.safetensors.index.json", d)
    for src in llama_dir.glob("*.safetensors"):
        raw = src.read_bytes()
        head = raw[: 8 + int.from_bytes(raw[:8], "little")]
        (cut / src.name).write_bytes(head)
        with (whole / src.name).open("wb") as f:
            f.write(head)
            f.truncate(len(raw))

    def summary(index: WeightIndex) -> dict:
        return {n: (i.file.name, i.dtype, i.shape, i.nbytes) for n, i in index.tensors.items()}

    assert summary(WeightIndex.from_dir(whole)) == summary(WeightIndex.from_dir(llama_dir))
    with pytest.raises(ValueError, match="is truncated: its header places tensors up to byte"):
        WeightIndex.from_dir(cut)


def test_part_of_names_layer_embedding_and_head(llama_dir: Path, bigcode_dir: Path) -> None:
    llama, bigcode = ModelConfig.from_dir(llama_dir), ModelConfig.from_dir(bigcode_dir)
    assert part_of(llama, "model.embed_tokens.weight") == "embed"
    assert part_of(llama, "model.layers.3.mlp.up_proj.weight") == 3
    assert part_of(llama, "model.norm.weight") == "head"
    assert part_of(llama, "lm_head.weight") == "head"
    assert part_of(bigcode, "transformer.wpe.weight") == "embed"
    assert part_of(bigcode, "transformer.h.2.attn.c_attn.bias") == 2
    assert part_of(bigcode, "transformer.ln_f.bias") == "head"
    with pytest.raises(ValueError, match="belongs to no part"):
        part_of(llama, "vision_tower.patch_embed.weight")
    with pytest.raises(ValueError, match="the model has 4"):
        part_of(llama, "model.layers.4.mlp.up_proj.weight")


def test_middle_slice_reads_only_its_layers(llama_dir: Path, reads: list) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    load_model(llama_dir, cfg, range(1, 3), torch.float32)
    index = WeightIndex.from_dir(llama_dir)
    assert {name for _, name in reads} == {n for n in index.tensors if part_of(cfg, n) in (1, 2)}
    assert len(reads) == len(set(reads))
    assert {file for file, _ in reads} == {index[n].file.name for _, n in reads}


def test_first_and_last_slices_read_embedding_and_head(llama_dir: Path, reads: list) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    load_model(llama_dir, cfg, range(0, 1), torch.float32)
    first = {name for _, name in reads}
    reads.clear()
    load_model(llama_dir, cfg, range(3, 4), torch.float32)
    last = {name for _, name in reads}
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert {"lm_head.weight", "model.norm.weight"} <= last
    assert "model.embed_tokens.weight" not in last


def test_tied_last_slice_reads_its_own_embedding_copy(qwen2_dir: Path, reads: list) -> None:
    cfg = ModelConfig.from_dir(qwen2_dir)
    load_model(qwen2_dir, cfg, range(1, 2), torch.float32)
    assert not any(part_of(cfg, n) in ("embed", "head") for _, n in reads)
    reads.clear()
    load_model(qwen2_dir, cfg, range(2, 3), torch.float32)
    assert "model.embed_tokens.weight" in {n for _, n in reads}


def test_stage_bytes_of_any_split_add_up_to_the_parts(qwen2_dir: Path, llama_dir: Path) -> None:
    for path in (qwen2_dir, llama_dir):
        cfg = ModelConfig.from_dir(path)
        index = WeightIndex.from_dir(path)
        parts = index.bytes_by_part(cfg)
        file_bytes = sum(info.nbytes for info in index.tensors.values())
        tied_copy = index.nbytes("model.embed_tokens.weight") if cfg.tie_word_embeddings else 0
        assert parts.embed + sum(parts.layers) + parts.head == file_bytes + tied_copy
        assert index.stage_bytes(cfg, range(cfg.num_layers)) == file_bytes
        front, back = (
            index.stage_bytes(cfg, range(0, 1)),
            index.stage_bytes(cfg, range(1, cfg.num_layers)),
        )
        assert front == parts.embed + parts.layers[0]
        assert back == sum(parts.layers[1:]) + parts.head
        half = index.bytes_by_part(cfg, torch.bfloat16)
        assert 2 * half.embed == parts.embed and 2 * half.head == parts.head


def test_missing_tensor_is_named_in_the_error(bigcode_dir: Path, tmp_path: Path) -> None:
    for f in bigcode_dir.iterdir():
        shutil.copy(f, tmp_path)
    tensors = load_file(bigcode_dir / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = ModelConfig.from_dir(tmp_path)
    with pytest.raises(ValueError, match=r"missing transformer\.h\.1\.mlp\.c_fc\.bias"):
        load_model(tmp_path, cfg, range(cfg.num_layers), torch.float32)
    load_model(tmp_path, cfg, range(0, 1), torch.float32)  # a slice without layer 1 is fine


def test_unexpected_tensor_and_wrong_shape_are_named(llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    model = build_model(cfg, range(0, 1), torch.float32)
    good = {n: torch.zeros(t.shape) for n, t in model.weight_slots().items()}
    with pytest.raises(ValueError, match=r"unexpected model\.layers\.2\.mlp\.up_proj\.weight"):
        model.load_state({**good, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight has shape \(3, 2\)"):
        model.load_state({**good, "model.embed_tokens.weight": torch.zeros(3, 2)})


def test_weights_are_cast_to_the_requested_dtype(llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    model = load_model(llama_dir, cfg, range(2, 4), torch.bfloat16)
    expected = load_file(llama_dir / WeightIndex.from_dir(llama_dir)["lm_head.weight"].file.name)
    assert model.lm_head.dtype == torch.bfloat16
    assert torch.equal(model.lm_head, expected["lm_head.weight"].to(torch.bfloat16))


def test_directory_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        WeightIndex.from_dir(tmp_path)


def test_factory_writes_identical_weights_every_time(tmp_path: Path, llama_dir: Path) -> None:
    again = model_factory.llama_gqa(tmp_path)
    files = sorted(p.name for p in llama_dir.glob("*.safetensors"))
    assert files == sorted(p.name for p in again.glob("*.safetensors"))
    for name in files + ["tokenizer.json"]:
        assert (again / name).read_bytes() == (llama_dir / name).read_bytes(), name
