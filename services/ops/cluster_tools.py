"""CLI commands for running across hosts: `certs`, `deploy`, `cluster check`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _certs(args) -> None:
    from services.common.tls import issue_certificate
    from services.ops.cluster import load_cluster

    if args.config:
        config = load_cluster(args.config)
        out = Path(args.out) if args.out else config.tls_dir
        if out is None:
            raise ValueError(f"{config.path} has no [tls] dir; pass --out DIR")
        wanted: dict[str, list[str]] = {
            "core": [_host(config.core.listen)],
            "gateway": [config.gateway.host],
        }
        for worker in config.remote_workers:
            wanted[worker.name] = [_host(worker.address), _host(worker.listen)]
    else:
        if not (args.out and args.name):
            raise ValueError("pass --config cluster.toml, or --out DIR --name NAME [--host H ...]")
        out, wanted = Path(args.out), {args.name: []}
    if args.rotate and not ((out / "ca.pem").exists() and (out / "ca-key.pem").exists()):
        raise ValueError(f"--rotate issues new certificates under the cluster's CA, and {out} holds none")
    for name, own_hosts in wanted.items():
        # wildcard listen addresses name no host a certificate could be for (binds nothing)
        hosts = [h for h in [*own_hosts, *(args.host or [])] if h and h not in ("0.0.0.0", "::")]  # nosec B104
        files = issue_certificate(out, name, hosts)
        print(f"{name}: {files.cert} ({', '.join(dict.fromkeys(hosts)) or 'localhost only'})")
    print(f"CA: {out / 'ca.pem'} (keep {out / 'ca-key.pem'} off the serving hosts)")
    if args.rotate:
        print("copy each service its new pair, then `kill -HUP` it: new connections get the new certificate")


def _host(address: str) -> str:
    if address.startswith("unix:"):
        return "localhost"
    return address.rsplit(":", 1)[0].strip("[]")


def _deploy(args) -> None:
    """Render the unit, create the folders it needs that its supervisor does not, and say what was
    done and what is left (notes go to stderr, so a unit printed to stdout stays clean)."""
    from services.ops.cluster import load_cluster
    from services.ops.deploy import default_launchd_log_dir, render_launchd, render_systemd
    from services.ops.deploy_sandbox import (
        blocked_for,
        folders_to_create,
        prepare_folder,
        user_exists,
        useradd_line,
    )

    config = load_cluster(args.config)
    log_dir = Path(args.log_dir).expanduser().absolute() if args.log_dir else None
    notes = []
    if args.kind == "launchd":
        log_dir = log_dir or default_launchd_log_dir()
        rendered = render_launchd(config, args.role, log_dir, cache=args.cache_dir)
        # launchd opens StandardOutPath before starting the job and does not create its folder
        notes.append("log folder " + prepare_folder(log_dir, None))
    else:
        rendered = render_systemd(config, args.role, user=args.user, cache=args.cache_dir, log_dir=log_dir)
        paths = rendered.paths
        for folder in folders_to_create(paths, log_dir):
            notes.append("writable folder " + prepare_folder(folder, args.user))
        if not user_exists(args.user):
            notes.append(
                f"user {args.user} does not exist on this host: create it (`{useradd_line(args.user)}`)"
            )
        for blocked in blocked_for(args.user, paths.reads):
            notes.append(f"{args.user} cannot reach {blocked}: grant access, move it, or pass --user")
        notes.append(f"logs: {log_dir}" if log_dir else f"logs: journalctl -u {rendered.filename}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / rendered.filename).write_text(rendered.text)
        print(out / rendered.filename)
    else:
        sys.stdout.write(rendered.text)
    for note in notes:
        print(note, file=sys.stderr)


def _cluster_check(args) -> None:
    from services.ops.cluster import load_cluster
    from services.ops.cluster_check import check_cluster

    report = check_cluster(load_cluster(args.config), probe=not args.offline, timeout_s=args.timeout)
    for line in report.lines():
        print(line)
    print("cluster check passed" if report.ok else f"cluster check failed: {len(report.errors)} error(s)")
    if not report.ok:
        sys.exit(1)


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="make a cluster CA and a certificate per service (mTLS)")
    p.add_argument("--config", default=None, help="cluster.toml: one certificate per service in it")
    p.add_argument("--out", default=None, help="folder (default: [tls] dir of --config)")
    p.add_argument("--name", default=None, help="without --config: the one service to certify")
    p.add_argument("--host", action="append", help="extra host name or IP for the certificates")
    p.add_argument(
        "--rotate",
        action="store_true",
        help="new certificates under the existing CA (refused without one); services load them on SIGHUP",
    )
    p.set_defaults(func=_certs)

    p = sub.add_parser("deploy", help="render a launchd plist or systemd unit for a role on this host")
    p.add_argument("kind", choices=["launchd", "systemd"])
    p.add_argument("--config", required=True)
    p.add_argument("--role", required=True, help="core, gateway or worker:NAME")
    p.add_argument("--out", default=None, help="write into this folder (default: print)")
    p.add_argument(
        "--log-dir",
        default=None,
        help="log folder, created here (launchd default ~/Library/Logs/moe-mesh; systemd default: the journal)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="MOE_MESH_CACHE of the service (default [environment], else /Users/Shared/moe-mesh/cache "
        "for launchd, /var/lib/moe-mesh/cache for systemd)",
    )
    p.add_argument(
        "--user",
        default="moe-mesh",
        help="systemd User= (default moe-mesh; create it with "
        "`useradd --system --home-dir /var/lib/moe-mesh --shell /usr/sbin/nologin moe-mesh`)",
    )
    p.set_defaults(func=_deploy)

    p = sub.add_parser("cluster", help="cluster.toml tools")
    cluster_sub = p.add_subparsers(dest="cluster_command", required=True)
    c = cluster_sub.add_parser("check", help="validate a cluster.toml before launch")
    c.add_argument("--config", required=True)
    c.add_argument("--offline", action="store_true", help="do not contact the workers")
    c.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each worker")
    c.set_defaults(func=_cluster_check)
