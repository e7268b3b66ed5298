"""Where a `--model` lives: a local folder, or a Hugging Face repo id as `mlx_lm.load` takes it.

A repo id resolves from the local Hugging Face cache (`HF_HOME` / `HF_HUB_CACHE`) without the
network. When it is not cached, huggingface_hub downloads it (with its progress bar) unless the
hub is unreachable or `HF_HUB_OFFLINE` is set; then one line names both the cache and the repo.
The model's name for clients is its repo id, also for a folder taken from inside the cache.
"""

from __future__ import annotations

import re
from pathlib import Path

# what a checkpoint needs: config, weights, tokenizer and chat template files
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: str) -> Path:
    """The local checkpoint folder for `model` (a folder, or a Hugging Face repo id)."""
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve()
    if not _REPO_ID.fullmatch(model):
        raise FileNotFoundError(f"{model}: no such folder (and not a Hugging Face repo id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    # the user names the repo; its weights are safetensors, never pickles, and nothing runs on download
    try:
        return Path(snapshot_download(model, allow_patterns=CHECKPOINT_FILES, local_files_only=True))  # nosec B615
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(model, allow_patterns=CHECKPOINT_FILES))  # nosec B615
    except Exception as error:  # noqa: BLE001 - offline, unreachable, unknown repo, gated: one line
        raise FileNotFoundError(
            f"{model}: not in the Hugging Face cache ({HF_HUB_CACHE}) and not downloadable: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from None


def model_name(checkpoint: Path) -> str:
    """The name clients use for a checkpoint: the repo id of a Hugging Face cache snapshot
    (`…/models--org--name/snapshots/<commit>`), else the folder's name."""
    checkpoint = Path(checkpoint)
    repo = checkpoint.parent.parent.name
    if checkpoint.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return checkpoint.name
