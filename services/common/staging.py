"""Staging folders that long builds (a split, the demo model) write into before renaming them
into place. Each carries its builder's pid, so a later build can tell a folder whose process was
killed outright (no cleanup ran) from one that is still being written, and remove the first."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def staging_name(prefix: str) -> str:
    return f"{prefix}{os.getpid()}"


def remove_abandoned(parent: Path, prefix: str) -> None:
    """Remove `parent/{prefix}{pid}[-anything]` folders whose process is gone (or is this one)."""
    for folder in parent.glob(f"{prefix}*"):
        pid = folder.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
