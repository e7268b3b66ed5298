"""Soak: mixed API traffic against `moe-mesh up` for a while, then idle, loopback only.

    python bench/soak.py [--clients 64] [--seconds 600] [--warmup 60] [--idle 20] [--experts 3]

Starts `moe-mesh up --experts N` on the demo model. N clients loop over chat, completions and
messages, streamed and not, tool calls, JSON-schema output, long prompts, cancels and mid-stream
disconnects (bench/soak_traffic.py). Every 5 s it samples each process's RSS and open file
descriptors and core's running, waiting and KV bytes. Prints one JSON object and exits 1 when a
target is missed: an error other than a 429 or a cancel the client made; RSS growth after the
warm-up over 5 % in any process; KV bytes, running or waiting requests, or open file descriptors
not back to their idle values once the load stops. Core's prefix and MLX caches get small budgets
(--cache-gb) so that they fill within the warm-up: growth past it is then a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import log
from bench.soak_traffic import EXPECTED, Outcome, run_clients
from bench.workdir import bench_workdir

SAMPLE_S = 5.0
RSS_GROWTH_LIMIT = 0.05
FD_SLACK = 4  # sockets the gateway's pool or a worker's frame server may still hold open


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def core_stats(core_address: str) -> dict:
    from services.common.grpc_util import aio_channel
    from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

    async with aio_channel(core_address) as channel:
        stats = await core_pb2_grpc.CoreStub(channel).GetStats(core_pb2.GetStatsRequest(), timeout=10)
    return {
        "running": stats.running_requests,
        "waiting": stats.waiting_requests,
        "kv_cache_bytes": stats.kv_cache_bytes,
        "prefix_cache_bytes": stats.prefix_cache.bytes,
    }


async def sample(processes: dict[str, int], core_address: str, started: float) -> dict:
    row = {"t_s": round(time.monotonic() - started, 1)}
    for name, pid in processes.items():
        row[name] = {"rss_mb": round(rss_mb(pid), 1), "fds": open_fds(pid)}
    row["core_stats"] = await core_stats(core_address)
    return row


async def soak(url: str, model: str, processes: dict[str, int], core_address: str, args) -> dict:
    """Idle sample, the load with samples every SAMPLE_S, then the idle wait and a last sample."""
    started = time.monotonic()
    idle = await sample(processes, core_address, started)
    load = asyncio.ensure_future(run_clients(url, model, args.clients, args.seconds, args.seed))
    samples = []
    while not load.done():
        await asyncio.wait([load], timeout=SAMPLE_S)
        samples.append(await sample(processes, core_address, started))
        log(
            f"t={samples[-1]['t_s']:.0f}s core {samples[-1]['core']['rss_mb']:.0f} MB, {samples[-1]['core_stats']}"
        )
    outcomes = load.result()
    await asyncio.sleep(args.idle)
    after = await sample(processes, core_address, started)
    return summarize(outcomes, idle, samples, after, processes, args)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


def summarize(outcomes: list[Outcome], idle: dict, samples: list[dict], after: dict, processes, args) -> dict:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    errors: dict[str, list[str]] = defaultdict(list)
    for o in outcomes:
        by_kind[o.kind][o.outcome] += 1
        if o.outcome not in EXPECTED and len(errors[f"{o.kind}:{o.outcome}"]) < 5:
            errors[f"{o.kind}:{o.outcome}"].append(o.detail)
    unexpected = sum(1 for o in outcomes if o.outcome not in EXPECTED)
    warm = [s for s in samples if s["t_s"] >= args.warmup] or samples[-1:]
    growth = {}
    for name in processes:
        base = warm[0][name]["rss_mb"]
        growth[name] = round((max(s[name]["rss_mb"] for s in warm) - base) / base * 100, 2)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    gaps = [g for o in outcomes for g in o.gaps_s]
    back = after["core_stats"]
    idle_stats = idle["core_stats"]
    targets = {
        "no_unexpected_errors": unexpected == 0,
        "rss_growth_after_warmup_within_5pct": all(g <= RSS_GROWTH_LIMIT * 100 for g in growth.values()),
        "kv_and_requests_back_to_idle": back["running"] == 0
        and back["waiting"] == 0
        and back["kv_cache_bytes"] == idle_stats["kv_cache_bytes"],
        "file_descriptors_back_to_idle": all(after[n]["fds"] <= idle[n]["fds"] + FD_SLACK for n in processes),
    }
    return {
        "requests": len(outcomes),
        "requests_per_s": round(len(outcomes) / args.seconds, 2),
        "outcomes_by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "unexpected_errors": unexpected,
        "error_examples": dict(errors),
        "count_429": sum(1 for o in outcomes if o.outcome == "429"),
        "ttft_ms": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99)},
        "inter_token_ms": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)},
        "rss_growth_after_warmup_pct": growth,
        "idle": idle,
        "after_idle": after,
        "samples": samples,
        "targets": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--warmup", type=float, default=60, help="seconds of load before RSS growth counts")
    parser.add_argument(
        "--idle", type=float, default=20, help="seconds after the load before the last sample"
    )
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache-gb",
        type=float,
        default=0.25,
        help="core's --prefix-cache-gb and --mlx-cache-gb: small, so both fill within the warm-up",
    )
    parser.add_argument("up_flags", nargs="*", help="more `moe-mesh up` flags (after --)")
    args = parser.parse_args()

    from tests.e2e.test_up import service_pids, start_up

    workdir = bench_workdir("mm-soak-")
    up_dir = workdir / "up"
    caches = ["--prefix-cache-gb", str(args.cache_gb), "--mlx-cache-gb", str(args.cache_gb)]
    flags = ["--experts", str(args.experts), "--served-model-name", "demo", *caches, *args.up_flags]
    proc, url = start_up(workdir / "cache", up_dir, *flags)
    try:
        processes = {
            "core": service_pids(proc.pid, "core")[0],
            "gateway": service_pids(proc.pid, "gateway")[0],
        }
        for i, pid in enumerate(sorted(service_pids(proc.pid, "expert"))):
            processes[f"expert-{i}"] = pid
        log(f"soak: {args.clients} clients for {args.seconds:.0f} s against {url}")
        report = asyncio.run(
            soak(url.removesuffix("/v1"), "demo", processes, f"unix:{up_dir / 'core.sock'}", args)
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report = {
        "bench": "soak",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "model": "demo",
        "experts": args.experts,
        "clients": args.clients,
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "idle_s": args.idle,
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        **report,
    }
    print(json.dumps(report, indent=1))
    sys.exit(0 if all(report["targets"].values()) else 1)


if __name__ == "__main__":
    main()
