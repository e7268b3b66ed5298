"""Paths a rendered service reads and writes, and the systemd sandbox computed from them.

A systemd unit runs as a non-root user under `ProtectSystem=strict`: the whole file system is
read-only except what `ReadWritePaths=` names (the cache, the folders it binds Unix sockets in, the
log folder). Folders under /var/lib, /var/cache, /var/log or /run named `moe-mesh` are also systemd's
own (`StateDirectory=` and kin): systemd creates them owned by the user at every start, which /run
(a tmpfs) needs after a reboot. `ProtectHome=` hides /home, /root and /run/user unless something
the service reads or writes lives there, and then makes them read-only; `PrivateTmp=` gives the
service its own /tmp unless one of its paths is in the shared one. Connecting to a Unix socket
needs no write access to its folder, so only the folders a role binds in are made writable.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from services.ops.cluster import ClusterConfig

HOME_ROOTS = ("/home", "/root", "/run/user")
# paths compared against, never written to
TMP_ROOTS = ("/tmp", "/var/tmp")  # nosec B108
# systemd-managed folders: created, owned by User= and writable at every start
MANAGED = {
    "/var/lib": "StateDirectory",
    "/var/cache": "CacheDirectory",
    "/var/log": "LogsDirectory",
    "/run": "RuntimeDirectory",
}
MANAGED_NAME = "moe-mesh"
# top folders one platform has and the other lacks: a path under them is for the wrong system
LINUX_ONLY = (
    "/home",
    "/root",
    "/run",
    "/srv",
    "/var/lib",
    "/var/log",
    "/var/cache",
    "/etc/systemd",
    "/proc",
    "/sys",
)
MACOS_ONLY = ("/Users", "/Library", "/Volumes", "/System", "/Applications", "/private", "/opt/homebrew")


def under(path: PurePosixPath | str, root: str) -> bool:
    path = str(path)
    return path == root or path.startswith(root.rstrip("/") + "/")


def foreign_path(value: str, kind: str) -> bool:
    """A value that is a path only the other platform has (macOS paths in a systemd unit,
    Linux paths in a launchd plist)."""
    roots = MACOS_ONLY if kind == "systemd" else LINUX_ONLY
    return value.startswith("/") and any(under(value, root) for root in roots)


@dataclass(frozen=True)
class ServicePaths:
    reads: tuple[Path, ...]  # what it needs to read: Python, moe-mesh, config, split, certificates
    writes: tuple[Path, ...]  # what it writes: cache, socket folders, logs


def bound_socket_folders(config: ClusterConfig, role: str) -> list[Path]:
    """Folders of the Unix sockets a role listens on (a worker's frame socket sits beside its
    gRPC socket); relative paths are relative to the working directory, the config's folder."""
    from services.common.grpc_util import unix_socket_path

    if role == "core":
        listens = [config.core.listen]
    elif role.startswith("worker:"):
        listens = [config.worker(role.split(":", 1)[1]).listen]
    else:
        listens = []  # the gateway serves HTTP on host:port
    sockets = [unix_socket_path(address) for address in listens]
    return [config.path.parent / socket.parent for socket in sockets if socket is not None]


def service_paths(
    config: ClusterConfig, role: str, cache: Path, environment: dict[str, str], log_dir: Path | None
) -> ServicePaths:
    executable = Path(sys.executable)
    reads = [
        executable.parent,
        executable.resolve().parent,
        Path(sys.prefix),
        Path(sys.base_prefix),
        Path(__file__).resolve().parents[1],  # the services package
        config.path.parent,
        config.split,
        *([config.tls_dir] if config.tls_dir else []),
        *(Path(v) for v in environment.values() if v.startswith("/") and os.pathsep not in v),
    ]
    writes = [cache, *bound_socket_folders(config, role), *([log_dir] if log_dir else [])]
    return ServicePaths(_unique(reads), _unique(writes))


def _unique(paths: list[Path]) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(Path(os.path.normpath(p)) for p in paths))


def managed_directory(path: Path) -> tuple[str, Path] | None:
    """(directive, folder) when systemd creates and owns the folder holding `path`: /var/lib/moe-mesh
    and kin. The service creates what it needs below it."""
    for base, directive in MANAGED.items():
        if under(path, f"{base}/{MANAGED_NAME}"):
            return directive, Path(base) / MANAGED_NAME
    return None


def writable_paths(paths: ServicePaths) -> tuple[Path, ...]:
    """ReadWritePaths=: each written path, or the systemd-managed folder holding it (a listed path
    must exist when the service starts, and systemd creates only that folder)."""
    return _unique([managed[1] if (managed := managed_directory(p)) else p for p in paths.writes])


def sandbox(paths: ServicePaths, quote) -> list[str]:
    """The unit's computed sandbox lines; `quote` renders one path as a systemd list item."""
    everything = [*paths.reads, *paths.writes]
    lines = []
    home = [p for p in everything if any(under(p, root) for root in HOME_ROOTS)]
    if home:
        lines.append(f"# ProtectHome=read-only, not yes: {_one_line(home[0])} is under a home folder")
        lines.append("ProtectHome=read-only")
    else:
        lines.append("ProtectHome=yes")
    in_tmp = [p for p in everything if any(under(p, root) for root in TMP_ROOTS)]
    if in_tmp:
        lines.append(f"# PrivateTmp=no, not yes: {_one_line(in_tmp[0])} is in the shared /tmp")
        lines.append("PrivateTmp=no")
    else:
        lines.append("PrivateTmp=yes")
    lines.append("ReadWritePaths=" + " ".join(quote(p) for p in writable_paths(paths)))
    managed = sorted({m for m in map(managed_directory, paths.writes) if m})
    lines.extend(f"{directive}={MANAGED_NAME}" for directive, _ in managed)
    if any(directive == "RuntimeDirectory" for directive, _ in managed):
        lines.append("# the runtime folder is shared by the units on this host: kept when one stops")
        lines.append("RuntimeDirectoryPreserve=yes")
    return lines


def _one_line(path: Path) -> str:
    """A path as comment text: a line break in it would end the comment."""
    return str(path).replace("\n", "\\n")


def folders_to_create(paths: ServicePaths, log_dir: Path | None) -> list[Path]:
    """Written folders systemd does not create: ReadWritePaths= of a missing folder fails the
    start, and so does a log file whose folder is missing (opened before LogsDirectory= exists)."""
    return [p for p in paths.writes if managed_directory(p) is None or p == log_dir]


def prepare_folder(path: Path, user: str | None) -> str:
    """Create `path` (owned by `user` when this runs as root and the user exists); one line to print."""
    if path.is_dir():
        return f"{path}: exists"
    try:
        path.mkdir(parents=True)
    except OSError as error:
        owner = f"-o {user} " if user else ""
        return f"{path}: cannot create it here ({error.strerror}); create it: sudo install -d {owner}{path}"
    if user and os.geteuid() == 0 and user_exists(user):
        os.chown(path, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
        return f"{path}: created, owned by {user}"
    return f"{path}: created"


def user_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def useradd_line(user: str) -> str:
    return f"useradd --system --home-dir /var/lib/{MANAGED_NAME} --shell /usr/sbin/nologin {user}"


def blocked_for(user: str, paths: tuple[Path, ...]) -> list[str]:
    """For each path, the first existing folder on the way that `user` may not enter (by mode,
    owner and groups; ACLs aside). Empty for root and for users that do not exist."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return []
    if entry.pw_uid == 0:
        return []
    groups = set(os.getgrouplist(user, entry.pw_gid))
    found = []
    for path in paths:
        for folder in [*reversed(path.parents), path]:
            try:
                info = folder.stat()
            except OSError:
                break
            if not stat.S_ISDIR(info.st_mode):
                break
            if info.st_uid == entry.pw_uid:
                allowed = info.st_mode & stat.S_IXUSR
            elif info.st_gid in groups:
                allowed = info.st_mode & stat.S_IXGRP
            else:
                allowed = info.st_mode & stat.S_IXOTH
            if not allowed:
                owner = _name(pwd.getpwuid, info.st_uid), _name(grp.getgrgid, info.st_gid)
                found.append(
                    f"{path} ({folder} is {owner[0]}:{owner[1]} mode {stat.S_IMODE(info.st_mode):o})"
                )
                break
    return found


def _name(lookup, number: int) -> str:
    try:
        return lookup(number)[0]
    except KeyError:
        return str(number)
