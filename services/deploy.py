"""`moe-mesh deploy launchd|systemd`: render a service definition for one role on this host.

Roles: `core`, `gateway`, `worker:NAME` (a worker of cluster.toml). The rendered unit
runs this Python with `-m services.cli <role> --config <cluster.toml>`, so the service
reads the same file as `cluster check` validated; restarts are the supervisor's
(launchd KeepAlive + ThrottleInterval, systemd Restart=always + RestartSec), and the
stop timeout leaves room for the drain (health NOT_SERVING, in-flight requests finish
within the server's grace period) before SIGKILL. Templates live in `deploy/`.
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

from services.cli import cli_command
from services.cluster import ClusterConfig

TEMPLATES = Path(__file__).resolve().parents[1] / "deploy"
THROTTLE_S = 5
STOP_TIMEOUT_S = 45  # > the gateway's 30 s graceful shutdown and core's 10 s gRPC grace
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Rendered:
    filename: str
    text: str


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


def _environment(config: ClusterConfig) -> dict[str, str]:
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "PYTHONUNBUFFERED": "1",
    }
    if "MOE_MESH_CACHE" in os.environ:
        env["MOE_MESH_CACHE"] = os.environ["MOE_MESH_CACHE"]
    env.update(config.environment)
    return env


def render_launchd(config: ClusterConfig, role: str, log_dir: Path) -> Rendered:
    short, args = role_command(config, role)
    label = f"com.moe-mesh.{short}"
    argv = cli_command(*args)
    text = Template((TEMPLATES / "launchd.plist.template").read_text()).substitute(
        role=escape(role),
        label=escape(label),
        program_arguments="\n".join(f"    <string>{escape(a)}</string>" for a in argv),
        working_directory=escape(str(config.path.parent)),
        environment="\n".join(
            f"    <key>{escape(k)}</key>\n    <string>{escape(v)}</string>"
            for k, v in _environment(config).items()
        ),
        throttle_s=THROTTLE_S,
        stop_timeout_s=STOP_TIMEOUT_S,
        stdout_path=escape(str(log_dir / f"moe-mesh-{short}.log")),
        stderr_path=escape(str(log_dir / f"moe-mesh-{short}.err.log")),
    )
    return Rendered(f"{label}.plist", text)


def render_systemd(config: ClusterConfig, role: str, user: str | None = None) -> Rendered:
    short, args = role_command(config, role)
    unit = f"moe-mesh-{short}.service"
    argv = cli_command(*args)
    text = Template((TEMPLATES / "systemd.service.template").read_text()).substitute(
        role=role,
        unit_name=unit,
        label=f"moe-mesh-{short}",
        exec_start=" ".join(_systemd_quote(a) for a in argv),
        working_directory=_systemd_path(config.path.parent),
        environment="\n".join(
            f"Environment={_systemd_assignment(k, v)}" for k, v in _environment(config).items()
        ),
        user_line=f"User={user}" if user else "",
        throttle_s=THROTTLE_S,
        stop_timeout_s=STOP_TIMEOUT_S,
    )
    return Rendered(unit, text)


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
