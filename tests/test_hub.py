"""Model ids: a local directory, or a Hugging Face Hub id resolved in the
Hub cache (laid out in a temp dir, offline)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringserve.config import UserError
from ringserve.models.hub import resolve_model
from tests.hub_cache import COMMIT, REPO_ID, offline_env, write_hub_cache


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    write_hub_cache(home)
    return home


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(hf_home):
    """The cached listing also names files ringserve never reads, which the
    snapshot lacks: resolving succeeds offline only because they are not
    asked for."""
    cache = hf_home / "hub"
    path = resolve_model(REPO_ID, cache_dir=cache, local_files_only=True)
    assert path == cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    same = resolve_model(REPO_ID, COMMIT, cache_dir=cache, local_files_only=True)
    assert same == path


def test_a_local_directory_is_used_as_it_is(hf_home):
    snapshot = resolve_model(REPO_ID, cache_dir=hf_home / "hub", local_files_only=True)
    assert resolve_model(str(snapshot)) == snapshot


def test_a_model_neither_here_nor_cached_is_a_user_error(hf_home, tmp_path):
    with pytest.raises(UserError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model("nobody/nothing", cache_dir=hf_home / "hub", local_files_only=True)
    with pytest.raises(UserError, match="no such directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "README.md").write_text("a file, named as a Hub id could be")
    with pytest.raises(UserError, match="is a file: give the directory"):
        resolve_model(str(tmp_path / "README.md"))
    with pytest.raises(UserError, match="is a file"):  # relative, as typed in a checkout
        resolve_model(os.path.relpath(tmp_path / "README.md"))
    with pytest.raises(UserError, match="--revision"):
        resolve_model(str(tmp_path), revision="main")


@pytest.mark.timeout(60)
def test_the_command_line_plans_a_hub_id_offline_from_hf_home(hf_home):
    """The Hub client's own settings apply: HF_HOME finds the cache and
    HF_HUB_OFFLINE keeps it off the network."""
    cmd = [sys.executable, "-m", "ringserve", "plan", "--model", REPO_ID, "--pp", "2",
           "--rank-memory-mib", "200,200"]  # fmt: skip
    env = {**os.environ, **offline_env(hf_home)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "T = " in done.stdout
    cmd[cmd.index(REPO_ID)] = "nobody/nothing"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "nobody/nothing@main is not in the Hugging Face cache" in done.stderr


def test_llm_takes_a_hub_id_and_serves_its_snapshot(hf_home, monkeypatch):
    from huggingface_hub import constants

    from ringserve import LLM, SamplingParams

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with LLM(REPO_ID, kv_capacity_tokens=1024) as llm:
        assert llm.config.model_dir.name == COMMIT
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    assert len(out.token_ids) == 3 and out.text
