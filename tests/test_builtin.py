"""The built-in model: deterministic, Hugging Face format, created once and
atomically, and it runs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve.cache.pool import KVPool
from ringserve.kernels.batch import ForwardBatch
from ringserve.models.builtin import BUILTIN_VERSION, builtin_model_dir
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model
from ringserve.models.tokenizer import Tokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_model_dir(tmp_path_factory.mktemp("cache"))


def test_generation_is_byte_for_byte_deterministic(builtin: Path, tmp_path: Path) -> None:
    again = builtin_model_dir(tmp_path)
    assert again != builtin
    for name in FILES:
        assert (again / name).read_bytes() == (builtin / name).read_bytes(), name


def test_existing_directory_is_reused(builtin: Path) -> None:
    before = {name: (builtin / name).stat().st_mtime_ns for name in FILES}
    assert builtin_model_dir(builtin.parent) == builtin
    assert {name: (builtin / name).stat().st_mtime_ns for name in FILES} == before


def test_cache_dir_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert builtin_model_dir() == tmp_path / "env" / BUILTIN_VERSION


def test_one_cache_dir_for_everything_ringserve_makes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The built-in model and the CPU kernels alike: RINGSERVE_CACHE_DIR,
    else XDG_CACHE_HOME/ringserve, else ~/.cache/ringserve."""
    from ringserve.config import cache_dir

    monkeypatch.delenv("RINGSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ringserve"
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("RINGSERVE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ringserve"


def test_concurrent_creators_leave_one_complete_directory(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            results.append(builtin_model_dir(tmp_path))
        except BaseException as e:  # reported below, in the test thread
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert results == [tmp_path / BUILTIN_VERSION] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [BUILTIN_VERSION]  # no temp dirs left
    assert all((tmp_path / BUILTIN_VERSION / name).is_file() for name in FILES)


def test_architecture_is_the_documented_one(builtin: Path) -> None:
    cfg = ModelConfig.from_dir(builtin)
    tok = Tokenizer.from_dir(builtin)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size) == ("llama", 4, 256)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (4, 2, 688)
    assert cfg.vocab_size == tok.vocab_size == 2048
    assert cfg.eos_token_ids == (1, 3)
    assert tok.eos_token_id == 1
    assert "<|im_start|>assistant\n" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


@torch.no_grad()
def test_loads_and_greedy_decodes_as_transformers_does(builtin: Path) -> None:
    cfg = ModelConfig.from_dir(builtin)
    tok = Tokenizer.from_dir(builtin)
    model = load_model(builtin, cfg, range(cfg.num_layers), torch.float32)
    pool = KVPool(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    prompt = tok.encode("The river starts")
    ids, new = list(prompt), len(prompt)
    probs = []
    for _ in range(12):
        batch = ForwardBatch.build([list(range(1, len(ids) + 1))], [new], [True])
        hidden = model(torch.tensor(ids[-new:]), batch, pool)
        logits = model.logits(hidden[batch.sample_rows])
        probs.append(logits.softmax(-1).max().item())
        ids.append(int(logits.argmax()))
        new = 1
    hf = AutoModelForCausalLM.from_pretrained(builtin, dtype=torch.float32)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert ids == expected[0].tolist()
    # Peaked next-token distributions, not near-uniform over 2048 tokens.
    assert sum(probs) / len(probs) > 0.3
