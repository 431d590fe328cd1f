"""A Hugging Face Hub cache laid out on disk as the Hub client writes it
(`models--org--name/{blobs,snapshots/<commit>,refs/main}`), holding the
built-in model under a Hub id, for tests that run with `HF_HUB_OFFLINE=1`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ringserve.models.builtin import write_builtin_model

REPO_ID = "ringserve-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
UNFETCHED = ("pytorch_model.bin", "onnx/model.onnx", "README.md")  # files ringserve never reads


def write_hub_cache(hf_home: Path, repo_id: str = REPO_ID, commit: str = COMMIT) -> Path:
    """Write the cache under `hf_home/hub`; returns the snapshot directory.
    Files live in `blobs/` (named by their hash) and the snapshot links to
    them, as in a real cache. The cached tree listing names the repository's
    files, among them `UNFETCHED` ones the snapshot lacks: an offline
    resolve that asks for any of those finds the snapshot incomplete."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    source = hf_home / "source"
    source.mkdir()
    write_builtin_model(source)
    for f in sorted(source.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    source.rmdir()
    listing = {p.name: {"size": p.stat().st_size, "blob_id": "0" * 40} for p in snapshot.iterdir()}
    listing |= {name: {"size": 1, "blob_id": "0" * 40} for name in UNFETCHED}
    (repo / "trees").mkdir()
    tree = {"format_version": 1, "files": listing}
    (repo / "trees" / f"{commit}.json").write_text(json.dumps(tree))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
