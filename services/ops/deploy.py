"""`moe-mesh deploy launchd|systemd`: render a service definition for one role on this host.

Roles: `core`, `gateway`, `worker:NAME` (a worker of cluster.toml). The rendered unit
runs this Python with `-m services.ops.cli <role> --config <cluster.toml>`, so the service
reads the same file as `cluster check` validated; restarts are the supervisor's
(launchd KeepAlive + ThrottleInterval, systemd Restart=always + RestartSec), and the
stop timeout leaves room for the drain (health NOT_SERVING, in-flight requests finish
within the server's grace period) before SIGKILL. Templates live in `deploy/`.

Paths are the platform's own: the cache (MOE_MESH_CACHE) defaults to /Users/Shared/moe-mesh/cache
in a plist and /var/lib/moe-mesh/cache in a unit; `[environment]` or --cache-dir set another, and a
path only the other platform has is refused. launchd logs to files in a folder that must exist
before it loads the plist (`moe-mesh deploy` creates it); systemd units log to the journal unless
given a log folder, run as a non-root user (default `moe-mesh`) and are sandboxed
(services/ops/deploy_sandbox.py).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

# escapes text written into plists; parses nothing
from xml.sax.saxutils import escape  # nosec B406

from services.ops.cluster import ClusterConfig
from services.ops.command import cli_command
from services.ops.deploy_sandbox import ServicePaths, foreign_path, sandbox, service_paths, useradd_line

TEMPLATES = Path(__file__).resolve().parents[2] / "deploy"
THROTTLE_S = 5
STOP_TIMEOUT_S = 45  # > the gateway's 30 s graceful shutdown and core's 10 s gRPC grace
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]*[$]?$")
DEFAULT_USER = "moe-mesh"
DEFAULT_CACHE = {"launchd": Path("/Users/Shared/moe-mesh/cache"), "systemd": Path("/var/lib/moe-mesh/cache")}
CACHE_VARIABLE = "MOE_MESH_CACHE"


@dataclass(frozen=True)
class Rendered:
    filename: str
    text: str
    paths: ServicePaths | None = None  # what a systemd unit reads and writes


def role_command(config: ClusterConfig, role: str) -> tuple[str, list[str]]:
    """(short name, moe-mesh arguments) for a role; raises ValueError naming the valid roles."""
    if role in ("core", "gateway"):
        return role, [role, "--config", str(config.path)]
    if role.startswith("worker:"):
        name = role.split(":", 1)[1]
        if config.worker(name).is_local:  # (raises naming the workers when there is none)
            raise ValueError(f"worker {name!r} is local: it runs inside core, no service of its own")
        if not _SAFE_NAME.match(name):
            raise ValueError(f"worker name {name!r} must be letters, digits, '.', '_' or '-'")
        return f"worker-{name}", ["expert", "--config", str(config.path), "--name", name]
    workers = ", ".join(f"worker:{w.name}" for w in config.remote_workers)
    raise ValueError(f"--role {role!r}: expected core, gateway or one of {workers}")


def default_launchd_log_dir() -> Path:
    return Path.home() / "Library" / "Logs" / "moe-mesh"


def cache_dir(config: ClusterConfig, kind: str, chosen: Path | str | None = None) -> Path:
    """MOE_MESH_CACHE of a rendered service: `chosen` (--cache-dir), else [environment], else the
    platform's default; relative paths are relative to the config's folder (the working directory)."""
    value = chosen or config.environment.get(CACHE_VARIABLE) or DEFAULT_CACHE[kind]
    return config.path.parent / Path(value).expanduser()


def _environment(config: ClusterConfig, kind: str, cache: Path) -> dict[str, str]:
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "PYTHONUNBUFFERED": "1",
        **config.environment,
        CACHE_VARIABLE: str(cache),
    }
    system = "Linux" if kind == "systemd" else "macOS"
    for key, value in env.items():
        if key != "PATH" and foreign_path(value, kind):
            raise ValueError(
                f"{key}={value} is not a path on {system}, where a {kind} service runs"
                + (": pass --cache-dir" if key == CACHE_VARIABLE else f": set {key} for this platform")
            )
    return env


def render_launchd(
    config: ClusterConfig, role: str, log_dir: Path, cache: Path | str | None = None
) -> Rendered:
    """The plist of a LaunchAgent; its log folder must exist before launchd loads it."""
    short, args = role_command(config, role)
    if foreign_path(str(log_dir), "launchd"):
        raise ValueError(f"log folder {log_dir} is not a path on macOS, where launchd runs: pass --log-dir")
    environment = _environment(config, "launchd", cache_dir(config, "launchd", cache))
    label = f"com.moe-mesh.{short}"
    argv = cli_command(*args)
    text = Template((TEMPLATES / "launchd.plist.template").read_text()).substitute(
        role=escape(role),
        label=escape(label),
        program_arguments="\n".join(f"    <string>{escape(a)}</string>" for a in argv),
        working_directory=escape(str(config.path.parent)),
        environment="\n".join(
            f"    <key>{escape(k)}</key>\n    <string>{escape(v)}</string>" for k, v in environment.items()
        ),
        throttle_s=THROTTLE_S,
        stop_timeout_s=STOP_TIMEOUT_S,
        stdout_path=escape(str(log_dir / f"moe-mesh-{short}.log")),
        stderr_path=escape(str(log_dir / f"moe-mesh-{short}.err.log")),
    )
    return Rendered(f"{label}.plist", text)


def render_systemd(
    config: ClusterConfig,
    role: str,
    user: str = DEFAULT_USER,
    cache: Path | str | None = None,
    log_dir: Path | None = None,
) -> Rendered:
    """A sandboxed unit run as `user`; it logs to the journal, or to files in `log_dir`."""
    short, args = role_command(config, role)
    if not _USER_NAME.match(user):
        raise ValueError(f"--user {user!r} is not a user name")
    if log_dir is not None and foreign_path(str(log_dir), "systemd"):
        raise ValueError(f"log folder {log_dir} is not a path on Linux, where systemd runs: pass --log-dir")
    unit = f"moe-mesh-{short}.service"
    argv = cli_command(*args)
    environment = _environment(config, "systemd", cache_dir(config, "systemd", cache))
    paths = service_paths(config, role, Path(environment[CACHE_VARIABLE]), environment, log_dir)
    if log_dir is None:
        output = "StandardOutput=journal\nStandardError=journal"
    else:
        output = "\n".join(
            f"Standard{stream}=append:{_systemd_path(log_dir / f'moe-mesh-{short}{suffix}.log')}"
            for stream, suffix in (("Output", ""), ("Error", ".err"))
        )
    text = Template((TEMPLATES / "systemd.service.template").read_text()).substitute(
        role=role,
        unit_name=unit,
        label=f"moe-mesh-{short}",
        exec_start=" ".join(_systemd_quote(a) for a in argv),
        working_directory=_systemd_path(config.path.parent),
        environment="\n".join(f"Environment={_systemd_assignment(k, v)}" for k, v in environment.items()),
        user=user,
        useradd=useradd_line(user),
        throttle_s=THROTTLE_S,
        stop_timeout_s=STOP_TIMEOUT_S,
        output=output,
        sandbox="\n".join(sandbox(paths, _systemd_list_item)),
    )
    return Rendered(unit, text, paths)


def _systemd_quote(value: str) -> str:
    """systemd splits ExecStart like a shell but expands % specifiers and $VARS: escape them."""
    return shlex.quote(value.replace("%", "%%").replace("$", "$$"))


def _systemd_path(path: Path) -> str:
    """WorkingDirectory= takes the rest of the line as the path, unquoted (quotes would be part of
    it); only % specifiers are expanded."""
    text = str(path)
    if "\n" in text:
        raise ValueError(f"{text!r}: a path with a line break cannot go into a systemd unit")
    return text.replace("%", "%%")


def _systemd_assignment(key: str, value: str) -> str:
    """One Environment= assignment: double-quoted with C escapes; % specifiers are expanded there,
    $VARIABLES are not (so no $$)."""
    text = f"{key}={value}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if "\n" in text:
        raise ValueError(f"{key}: a value with a line break cannot go into a systemd unit")
    return f'"{text}"'


def _systemd_list_item(path: Path) -> str:
    """One path of a space-separated list such as ReadWritePaths=: double-quoted with C escapes,
    % specifiers escaped (they are expanded there, $VARIABLES are not)."""
    text = str(path)
    if "\n" in text:
        raise ValueError(f"{text!r}: a path with a line break cannot go into a systemd unit")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'
