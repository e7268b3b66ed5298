"""Claiming a Unix socket path before binding it.

A path is taken over only from a process that is gone: a file that is not a socket is the user's
and stays; a socket something still listens on belongs to a running service (a second worker or a
second `moe-mesh up` started on the same paths), which must not lose it without a word. Paths
longer than the OS allows fail with one line naming them rather than deep inside a bind.
"""

from __future__ import annotations

import socket
import stat
import sys
from pathlib import Path

# sun_path holds 108 bytes on Linux and 104 on macOS, the terminating NUL included
MAX_PATH_BYTES = 103 if sys.platform == "darwin" else 107


def path_fits(path: Path | str) -> bool:
    return len(str(path).encode()) <= MAX_PATH_BYTES


def claim_socket_path(path: Path | str) -> None:
    """Make `path` free to bind: create its folder, remove a stale socket. Raises OSError when
    the path is too long, holds something that is not a socket, or a live socket."""
    path = Path(path)
    if not path_fits(path):
        raise OSError(
            f"unix socket path {path} is {len(str(path).encode())} bytes; the limit is {MAX_PATH_BYTES}: "
            "choose a shorter path (or --workdir)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # nobody listens: left by a process that did not stop cleanly
        return
    except OSError:
        pass  # it exists and answers oddly (timeout on a full backlog): someone is there
    finally:
        probe.close()
    raise OSError(f"{path}: another process is listening on this socket; stop it or choose another path")
