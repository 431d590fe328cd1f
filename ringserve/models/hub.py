"""Where a model's files are: a local Hugging Face directory, or a Hub
model id resolved to a directory in the Hub cache.

`resolve_model` is called once, by whoever starts the ranks (the launcher,
the offline `LLM`); every rank is then given the resolved local directory,
so no rank process ever talks to the Hub. Only the files ringserve reads are
fetched (`MODEL_FILES`). The Hub client's own settings apply: `HF_HOME` /
`HF_HUB_CACHE` for the cache, `HF_HUB_OFFLINE=1` to use the cache alone,
`HF_TOKEN` for gated and private models.
"""

from __future__ import annotations

import re
from pathlib import Path

import structlog

from ringserve.config import UserError

log = structlog.get_logger(__name__)

# What the loader, the tokenizer and the planner read, and nothing else
# (no *.bin, *.pt, *.gguf or ONNX copies of the weights).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "*.safetensors",
    "model.safetensors.index.json",
)
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def resolve_model(
    model: str | Path,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    local_files_only: bool | None = None,
) -> Path:
    """The local directory of `model`: the directory itself when one exists
    at that path, else the snapshot of the Hub model id `model` at
    `revision` (default: main), downloaded into the cache when missing.
    `cache_dir` and `local_files_only` override the Hub client's settings
    (`HF_HUB_CACHE`, `HF_HUB_OFFLINE`). Raises UserError saying what to do."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise UserError(f"--revision {revision} applies to a Hub model id, not to {path}/")
        return _checked(path, str(model))
    text = str(model)
    if path.is_file():
        raise UserError(
            f"model {text!r} is a file: give the directory that holds the model's config.json "
            "and weights, or a Hugging Face model id"
        )
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise UserError(f"model {text!r}: no such directory, and not a Hugging Face model id")
    return _checked(_download(text, revision, cache_dir, local_files_only), text)


def _download(
    repo_id: str,
    revision: str | None,
    cache_dir: str | Path | None,
    local_files_only: bool | None,
) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision or 'main'}"
    offline = constants.is_offline_mode() if local_files_only is None else local_files_only
    try:
        local = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=list(MODEL_FILES),
            local_files_only=offline,
        )
    except GatedRepoError as exc:
        raise UserError(f"{at} is gated: accept its terms on the Hub and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise UserError(
            f"{repo_id} is neither a local directory nor a model on the Hugging Face Hub "
            "(private? set HF_TOKEN)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise UserError(f"{repo_id} has no revision {revision!r}") from exc
    except IncompleteSnapshotError as exc:
        raise UserError(f"the cached snapshot of {at} is incomplete: {exc}") from exc
    except LocalEntryNotFoundError as exc:
        why = "with HF_HUB_OFFLINE=1" if offline else "(no connection to the Hub?)"
        raise UserError(
            f"{at} is not in the Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE}) "
            f"and cannot be downloaded {why}"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise UserError(f"could not fetch {at} from the Hub: {exc}".splitlines()[0]) from exc
    log.info("model.resolved", model=repo_id, revision=revision, path=local)
    return Path(local)


def _checked(path: Path, given: str) -> Path:
    if not (path / "config.json").is_file():
        raise UserError(f"model {given!r}: {path} has no config.json, so it is no model directory")
    return path
