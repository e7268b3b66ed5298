"""Service files that work on first load: systemd units run as a non-root user in a sandbox whose
writable paths cover what the service writes, with Linux paths only; launchd plists parse, carry
macOS paths only, and their log folder exists once `moe-mesh deploy` has run."""

from __future__ import annotations

import os
import plistlib
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from services.ops.cli import build_parser
from services.ops.cluster import load_cluster
from services.ops.deploy import render_launchd, render_systemd
from services.ops.deploy_sandbox import LINUX_ONLY, MACOS_ONLY, ServicePaths, blocked_for, sandbox, under

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "cluster.toml"
ROLES = ["core", "gateway", "worker:mac-a", "worker:mac-b"]
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
}


def directives(text: str) -> dict[str, list[str]]:
    """Each directive of a unit with its values in order (comments and section headers left out)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def read_write_paths(unit: dict[str, list[str]]) -> list[str]:
    """ReadWritePaths= items (the renderer double-quotes each one)."""
    items = []
    for value in unit.get("ReadWritePaths", []):
        items += [item.replace('\\"', '"').replace("%%", "%") for item in value.strip('"').split('" "')]
    return items


def verify(text: str, name: str, folder: Path) -> None:
    """`systemd-analyze verify` says nothing about the unit (skips where it is missing)."""
    unit = folder / name
    unit.write_text(text)
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here; the unit text was checked above")
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], check=False, capture_output=True, text=True, timeout=60
    )
    ours = [line for line in (done.stdout + done.stderr).splitlines() if name in line]
    assert ours == [], ours


def deploy(argv: list[str]) -> None:
    """`moe-mesh deploy ARGV` without configuring logging (which would keep capsys's stream)."""
    args = build_parser().parse_args(["deploy", *argv])
    args.func(args)


def _socket_cluster(folder: Path, core_listen: str, worker_listen: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cluster.toml"
    path.write_text(
        '[model]\nsplit = "/srv/moe-mesh/split"\n'
        f'[core]\nlisten = "{core_listen}"\n'
        f'[[workers]]\nname = "w"\naddress = "{worker_listen}"\n'
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
def test_systemd_units_are_hardened_non_root_and_linux_only(role, tmp_path):
    rendered = render_systemd(load_cluster(EXAMPLE), role)
    unit = directives(rendered.text)
    for key, value in HARDENING.items():
        assert unit.get(key) == [value], (key, unit.get(key))
    assert unit["User"] == ["moe-mesh"]
    assert unit["ProtectHome"][0] in ("yes", "read-only", "tmpfs")
    assert unit["PrivateTmp"][0] in ("yes", "no")
    # the example is a cluster of Macs: its macOS paths stay out of a Linux unit (the lines naming
    # this host's Python and config folder name them wherever they are)
    host = ("#", "ExecStart=", "WorkingDirectory=", 'Environment="PATH=')
    chosen = "\n".join(line for line in rendered.text.splitlines() if not line.startswith(host))
    for root in MACOS_ONLY:
        assert f"{root}/" not in chosen, root
    assert 'Environment="MOE_MESH_CACHE=/var/lib/moe-mesh/cache"' in rendered.text
    assert "/var/lib/moe-mesh" in read_write_paths(unit) and unit["StateDirectory"] == ["moe-mesh"]
    verify(rendered.text, rendered.filename, tmp_path)


def test_systemd_sandbox_follows_the_paths():
    plain = sandbox(
        ServicePaths(
            reads=(Path("/usr/lib/python3.12"), Path("/srv/split")),
            writes=(Path("/var/lib/moe-mesh/cache"), Path("/run/moe-mesh"), Path("/var/log/moe-mesh")),
        ),
        lambda p: f'"{p}"',
    )
    assert "ProtectHome=yes" in plain and "PrivateTmp=yes" in plain
    assert 'ReadWritePaths="/var/lib/moe-mesh" "/run/moe-mesh" "/var/log/moe-mesh"' in plain
    for directive in ("StateDirectory", "RuntimeDirectory", "LogsDirectory"):
        assert f"{directive}=moe-mesh" in plain
    assert "RuntimeDirectoryPreserve=yes" in plain  # shared by core and workers on one host

    home = sandbox(
        ServicePaths(reads=(Path("/home/ann/venv"),), writes=(Path("/home/ann/cache"), Path("/srv/sock"))),
        lambda p: f'"{p}"',
    )
    assert "ProtectHome=read-only" in home and "ProtectHome=yes" not in home
    assert 'ReadWritePaths="/home/ann/cache" "/srv/sock"' in home
    assert not any(line.startswith("StateDirectory") for line in home)
    shared_tmp = sandbox(ServicePaths(reads=(Path("/tmp/cluster"),), writes=(Path("/srv/c"),)), str)
    assert "PrivateTmp=no" in shared_tmp and "ProtectHome=yes" in shared_tmp


@pytest.mark.slow
def test_systemd_unit_makes_what_the_service_writes_writable(tmp_path):
    """Cache, log folder and the folders the role binds Unix sockets in are writable; the folder
    of a socket a role only connects to is not (connecting needs no write access)."""
    sockets = tmp_path / "sockets"
    path = _socket_cluster(tmp_path / "etc", "unix:/run/moe-mesh/core.sock", f"unix:{sockets}/w.sock")
    config = load_cluster(path)
    logs = tmp_path / "logs"
    core = directives(render_systemd(config, "core", cache="/home/svc/cache", log_dir=logs).text)
    assert read_write_paths(core) == ["/home/svc/cache", "/run/moe-mesh", str(logs)]
    assert core["RuntimeDirectory"] == ["moe-mesh"] and core["ProtectHome"] == ["read-only"]
    assert core["StandardOutput"] == [f"append:{logs}/moe-mesh-core.log"]
    worker = render_systemd(config, "worker:w", user="svc")
    unit = directives(worker.text)
    assert unit["User"] == ["svc"]
    assert read_write_paths(unit) == ["/var/lib/moe-mesh", str(sockets)]
    assert unit["StandardOutput"] == ["journal"]
    gateway = directives(render_systemd(config, "gateway").text)
    assert read_write_paths(gateway) == ["/var/lib/moe-mesh"]
    for written in worker.paths.writes:  # each written path lies under a writable one
        assert any(under(written, listed) for listed in read_write_paths(unit)), written
    verify(worker.text, worker.filename, tmp_path)
    with pytest.raises(ValueError, match="not a user name"):
        render_systemd(config, "core", user="a b")


def test_platform_paths_are_refused_on_the_other_platform(tmp_path):
    path = _socket_cluster(tmp_path, "127.0.0.1:50051", "127.0.0.1:50061")
    path.write_text(path.read_text() + '[environment]\nMOE_MESH_CACHE = "/Users/Shared/moe-mesh/cache"\n')
    config = load_cluster(path)
    with pytest.raises(ValueError, match="MOE_MESH_CACHE=/Users/Shared/moe-mesh/cache .*--cache-dir"):
        render_systemd(config, "core")
    assert "/Users/" not in render_systemd(config, "core", cache="/var/lib/moe-mesh/cache").text
    with pytest.raises(ValueError, match="not a path on Linux"):
        render_systemd(config, "core", cache="/srv/c", log_dir=Path("/Library/Logs/moe-mesh"))
    with pytest.raises(ValueError, match="not a path on macOS"):
        render_launchd(config, "core", Path("/var/log/moe-mesh"))
    with pytest.raises(ValueError, match="MOE_MESH_CACHE=/var/lib/x is not a path on macOS"):
        render_launchd(config, "core", tmp_path / "logs", cache="/var/lib/x")


@pytest.mark.parametrize("role", ROLES)
def test_launchd_plists_have_macos_paths_only(role, tmp_path):
    plist = plistlib.loads(render_launchd(load_cluster(EXAMPLE), role, tmp_path / "logs").text.encode())
    environment = plist["EnvironmentVariables"]
    assert environment["MOE_MESH_CACHE"] == "/Users/Shared/moe-mesh/cache"
    # ProgramArguments, WorkingDirectory and PATH name this host's Python and config, wherever they are
    chosen = [v for k, v in environment.items() if k != "PATH"] + [
        plist["StandardOutPath"],
        plist["StandardErrorPath"],
    ]
    for value in chosen:
        assert not any(under(value, root) for root in LINUX_ONLY), value


def test_deploy_launchd_creates_the_log_folder(tmp_path, monkeypatch, capsys):
    """launchd does not start a job whose log folder is missing: deploy creates it and says so,
    the default (~/Library/Logs/moe-mesh) as well as --log-dir, printing or writing the plist."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    agents = tmp_path / "agents"
    deploy(["launchd", "--config", str(EXAMPLE), "--role", "core", "--out", str(agents)])
    default = tmp_path / "home" / "Library" / "Logs" / "moe-mesh"
    assert default.is_dir()
    captured = capsys.readouterr()
    assert captured.out.strip() == str(agents / "com.moe-mesh.core.plist")
    assert f"log folder {default}: created" in captured.err
    plist = plistlib.loads((agents / "com.moe-mesh.core.plist").read_bytes())
    assert Path(plist["StandardOutPath"]).parent == default

    chosen = tmp_path / "deep" / "logs"
    deploy(["launchd", "--config", str(EXAMPLE), "--role", "worker:mac-a", "--log-dir", str(chosen)])
    captured = capsys.readouterr()
    assert chosen.is_dir() and f"log folder {chosen}: created" in captured.err
    assert Path(plistlib.loads(captured.out.encode())["StandardErrorPath"]).parent == chosen


def test_deploy_systemd_creates_the_folders_and_names_the_user_to_create(tmp_path, capsys):
    sockets = tmp_path / "sockets"
    path = _socket_cluster(tmp_path / "etc", "127.0.0.1:50051", f"unix:{sockets}/w.sock")
    cache, logs, out = tmp_path / "cache", tmp_path / "logs", tmp_path / "units"
    user = "moe-mesh-absent"
    assert not any(entry.pw_name == user for entry in pwd.getpwall())
    args = ["systemd", "--config", str(path), "--role", "worker:w", "--user", user]
    deploy([*args, "--cache-dir", str(cache), "--log-dir", str(logs), "--out", str(out)])
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out / "moe-mesh-worker-w.service")
    assert cache.is_dir() and logs.is_dir() and sockets.is_dir()
    assert f"writable folder {sockets}: created" in captured.err
    assert f"useradd --system --home-dir /var/lib/moe-mesh --shell /usr/sbin/nologin {user}" in captured.err
    unit = directives((out / "moe-mesh-worker-w.service").read_text())
    assert read_write_paths(unit) == [str(cache), str(sockets), str(logs)] and unit["User"] == [user]


def test_a_folder_the_user_cannot_enter_is_named(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a folder owned by another user needs root")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here")
    private = tmp_path / "private"
    (private / "venv").mkdir(parents=True)
    private.chmod(0o700)
    blocked = blocked_for("nobody", (private / "venv", Path("/usr")))
    # the first folder on the way it cannot enter: `private`, or one of pytest's 0700 folders above it
    assert len(blocked) == 1 and blocked[0].startswith(f"{private / 'venv'} (")
    assert "mode 700)" in blocked[0]
    assert blocked_for("root", (private / "venv",)) == []
