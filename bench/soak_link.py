"""Soak with a slow link: the soak's mixed traffic against a cluster whose first worker core
reaches through a relay that, every --chaos-every seconds, delays each byte on that link by
50 ms for 10 s (bench/soak_chaos.py's `delay_link`), connections kept open. No request may fail.

    python bench/soak_link.py [--clients 16] [--seconds 120] [--chaos-every 30] [--experts 3]

`moe-mesh up` runs its workers on Unix sockets, which no relay can sit in, so this starts the
services itself from one cluster.toml: the first worker listens on loopback TCP and core dials
the relay in front of it (gRPC, since frame sockets are for Unix-socket workers); the others
listen on Unix sockets as under `up`. Prints one JSON object (the soak's report, and the requests
that overlapped a slow window against the others) and exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway import wait_http
from bench.models import log
from bench.soak import percentile, soak
from bench.soak_chaos import DELAY_MS, DELAY_S
from bench.soak_traffic import EXPECTED
from bench.workdir import bench_workdir


def slow_link_cluster(
    split: Path, work: Path, experts: int, relay_port: int, worker_port: int, http_port: int
):
    """cluster.toml text: expert-0 listens on 127.0.0.1:worker_port and core dials the relay's
    127.0.0.1:relay_port; the other workers and core on Unix sockets under `work`."""
    from services.ops.cluster import local_cluster_toml
    from services.ops.up import expert_ranges

    ranges = expert_ranges(_num_experts(split), experts, 1)
    workers = [(f"expert-{i}", f"unix:{work / f'expert-{i}.sock'}", span) for i, span in enumerate(ranges)]
    workers[0] = ("expert-0", f"127.0.0.1:{relay_port}", ranges[0])
    text = local_cluster_toml(split, f"unix:{work / 'core.sock'}", workers, "127.0.0.1", http_port)
    dialled = f'address = "127.0.0.1:{relay_port}"'
    return text.replace(dialled, f'{dialled}\nlisten = "127.0.0.1:{worker_port}"', 1)


def _num_experts(split: Path) -> int:
    from services.common.manifest import Manifest

    return Manifest.load(split).num_experts


def start_cluster(work: Path, cache: Path, args) -> tuple[dict[str, subprocess.Popen], str, str]:
    """The relay, the workers, core and the gateway, each once it serves: (processes, API URL,
    core's address)."""
    from services.ops.up import free_port, resolve_split
    from tests.helpers import spawn, wait_serving

    env = {"MOE_MESH_CACHE": str(cache)}  # where the demo model is built or found, here and in the services
    with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON
        split = resolve_split(None)
    relay_port, worker_port, http_port = free_port(), free_port(), free_port()
    config = work / "cluster.toml"
    config.write_text(slow_link_cluster(split, work, args.experts, relay_port, worker_port, http_port))
    relay = [sys.executable, str(Path(__file__).with_name("delay_relay.py"))]
    relay += ["--listen", f"127.0.0.1:{relay_port}", "--target", f"127.0.0.1:{worker_port}"]
    relay += ["--delay-ms", str(DELAY_MS), "--initial-delay-ms", "0"]
    procs = {
        "relay": subprocess.Popen(relay, stdout=subprocess.DEVNULL, stderr=open(work / "relay.log", "wb"))
    }
    for i in range(args.experts):
        name = f"expert-{i}"
        procs[name] = spawn(["expert", "--config", str(config), "--name", name], work / f"{name}.log", env)
    for i in range(args.experts):
        address = f"127.0.0.1:{worker_port}" if i == 0 else f"unix:{work / f'expert-{i}.sock'}"
        wait_serving(address, procs[f"expert-{i}"], 300, work / f"expert-{i}.log")
    caches = ["--prefix-cache-gb", str(args.cache_gb), "--mlx-cache-gb", str(args.cache_gb)]
    core_flags = ["--config", str(config), "--served-model-name", "demo", *caches]
    procs["core"] = spawn(["core", *core_flags], work / "core.log", env)
    core = f"unix:{work / 'core.sock'}"
    wait_serving(core, procs["core"], 300, work / "core.log")
    procs["gateway"] = spawn(["gateway", "--config", str(config)], work / "gateway.log", env)
    url = f"http://127.0.0.1:{http_port}"
    wait_http(url, procs["gateway"], 60)
    return procs, url, core


def soak_slow_link(cache: Path, work: Path, args) -> dict:
    """The soak against the slow-link cluster, with `delay_link` every args.chaos_every."""
    from tests.helpers import stop

    work.mkdir(parents=True, exist_ok=True)
    procs, url, core = start_cluster(work, cache, args)
    args.chaos_actions = "delay_link"
    try:
        log(
            f"soak: {args.clients} clients for {args.seconds:.0f} s, a worker link slowed every {args.chaos_every:.0f} s"
        )
        pids = lambda: {n: p.pid for n, p in procs.items()}  # noqa: E731
        report = asyncio.run(soak(url, "demo", pids, core, args, keep_outcomes=True))
    finally:
        stop(list(procs.values()))
    windows = [(f.t, f.t + DELAY_S) for f in report["chaos"].pop("fault_records")]
    report["by_link"] = by_link(report.pop("outcomes"), windows)
    report["targets"]["delayed_link_fails_no_request"] = report["unexpected_errors"] == 0
    return report


def by_link(outcomes, windows: list[tuple[float, float]]) -> dict:
    """Requests that overlapped a slow-link window against the others: how many, their errors,
    and their TTFT and duration p50/p99 (ms)."""

    def overlapped(o) -> bool:
        return any(o.started_at <= b and a <= o.started_at + o.seconds for a, b in windows)

    def figures(group) -> dict:
        ttfts = [o.ttft_s for o in group if o.ttft_s is not None]
        seconds = [o.seconds for o in group]
        return {
            "requests": len(group),
            "errors": sum(1 for o in group if o.outcome not in EXPECTED),
            "ttft_ms": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99)},
            "duration_ms": {"p50": percentile(seconds, 0.5), "p99": percentile(seconds, 0.99)},
        }

    return {
        "overlapped_slow_link": figures([o for o in outcomes if overlapped(o)]),
        "others": figures([o for o in outcomes if not overlapped(o)]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--chaos-every", type=float, default=30)
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-gb", type=float, default=0.25)
    args = parser.parse_args()
    args.warmup, args.idle, args.up_flags = 0, 5, []
    workdir = bench_workdir("mm-soak-link-")
    report = soak_slow_link(workdir / "cache", workdir / "cluster", args)
    report = {
        "bench": "soak_link",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "model": "demo",
        "experts": args.experts,
        "clients": args.clients,
        "seconds": args.seconds,
        "delay": {"ms": DELAY_MS, "for_s": DELAY_S, "every_s": args.chaos_every},
        "command": "python bench/soak_link.py " + " ".join(sys.argv[1:]),
        **report,
    }
    print(json.dumps(report, indent=1, default=str))
    sys.exit(0 if all(report["targets"].values()) else 1)


if __name__ == "__main__":
    main()
