"""The disk a split takes, checked before anything is written, and core's small files linked
rather than copied."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.common.manifest import ManifestError

GB = 1e9
MARGIN = 1.02  # layer records and headers add a little to the checkpoint's weight bytes


def split_bytes(model_path: Path) -> int:
    """Bytes a split of this checkpoint writes: its weights, re-laid out, and its small files."""
    return int(sum(f.stat().st_size for f in Path(model_path).iterdir() if f.is_file()) * MARGIN)


def check_free_space(model_path: Path, out_dir: Path) -> int:
    """The bytes the split needs; ManifestError naming both figures when the disk is short."""
    needed = split_bytes(model_path)
    target = out_dir.parent
    while not target.exists():
        target = target.parent
    free = shutil.disk_usage(target).free
    if free < needed:
        raise ManifestError(
            f"splitting {model_path.name} needs {needed / GB:.2f} GB in {target}, which has "
            f"{free / GB:.2f} GB free; free space or split elsewhere"
        )
    return needed


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where both sit on one filesystem (no bytes written), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy(source, target)
