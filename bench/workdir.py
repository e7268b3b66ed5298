"""Work folders for the benches' sockets and service logs, removed when the bench ends.

A bench that dies of an exception keeps its folder (the workers' and core's logs are what
tells why) and says where it is."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path


def bench_workdir(prefix: str = "mm-bench-") -> Path:
    """A fresh short folder under /tmp (Unix socket paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    atexit.register(_remove_unless_failed, path)
    return path


def _remove_unless_failed(path: Path) -> None:
    # the interpreter sets sys.last_value before atexit runs when the bench died of an exception
    if hasattr(sys, "last_value"):
        print(f"bench failed: logs kept in {path}", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)
