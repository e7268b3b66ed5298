"""Soak: mixed API traffic against `moe-mesh up` for a while, then idle, loopback only.

    python bench/soak.py [--clients 64] [--seconds 600] [--warmup 120] [--idle 20] [--chaos-every S]

Starts `moe-mesh up --experts N` on the demo model. N clients loop over chat, completions and
messages, streamed and not, tool calls, JSON-schema output, long prompts, cancels and mid-stream
disconnects (bench/soak_traffic.py). Every 5 s it samples each process's RSS and open file
descriptors and core's running, waiting and KV bytes. Prints one JSON object and exits 1 when a
target is missed: an error other than a 429 or a cancel the client made; RSS growth after the
warm-up over 5 % in any process; KV bytes, running or waiting requests, or open file descriptors
not back to their idle values once the load stops. RSS growth compares idle after the load with idle after a
warm-up load: both with core's prefix and MLX caches filled (small budgets, --cache-gb) and
nothing running, so growth between them is a leak; peaks under load are reported beside.
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
from bench.soak_chaos import ACTIONS, inject, judge
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
        "mlx_active_bytes": stats.mlx_active_bytes,
        "mlx_cache_bytes": stats.mlx_cache_bytes,
    }


def up_processes(up_pid: int) -> dict[str, int]:
    """{core, gateway, expert-N: pid} of what `moe-mesh up` runs now (restarts get new pids)."""
    from tests.e2e.test_up import children_of, role_of

    found = {}
    for pid in children_of(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue  # just exited
        role = role_of(argv)
        if role not in ("core", "gateway", "expert"):
            continue
        if role == "expert":  # up starts each as `expert --config … --name expert-N`
            role = argv[argv.index("--name") + 1] if "--name" in argv else f"expert-pid{pid}"
        found[role] = pid
    return found


async def sample(processes, core_address: str, started: float) -> dict:
    row: dict = {"t_s": round(time.monotonic() - started, 1)}
    for name, pid in processes().items():
        try:
            row[name] = {"rss_mb": round(rss_mb(pid), 1), "fds": open_fds(pid), "pid": pid}
        except (OSError, StopIteration):
            continue  # exited between the listing and the read
    try:
        row["core_stats"] = await core_stats(core_address)
    except Exception as error:  # noqa: BLE001 - core restarting under --chaos: the sample says so
        row["core_stats"] = {"error": type(error).__name__}
    return row


async def soak(url: str, model: str, processes, core_address: str, args, keep_outcomes: bool = False) -> dict:
    """An idle sample; the warm-up load, idle, a sample (the reference: caches filled, nothing
    running); the load, sampled every SAMPLE_S (faults too with --chaos-every); idle, a last
    sample. `processes()` gives {name: pid} of the services now. `keep_outcomes`: the report also
    holds every request's Outcome ("outcomes") and, under "chaos", each fault ("fault_records")."""
    started = time.monotonic()
    idle = await sample(processes, core_address, started)
    if args.warmup:
        log(f"warm-up: {args.clients} clients for {args.warmup:.0f} s")
        await run_clients(url, model, args.clients, args.warmup, args.seed + 1)
        await asyncio.sleep(args.idle)
    warm = await sample(processes, core_address, started)
    load = asyncio.ensure_future(run_clients(url, model, args.clients, args.seconds, args.seed))
    faults: list = []
    chaos = None
    if getattr(args, "chaos_every", 0):

        def pids_of(role: str) -> list[int]:
            return [pid for name, pid in processes().items() if name.startswith(role)]

        chaos = asyncio.ensure_future(
            inject(pids_of, time.monotonic() + args.seconds, args.chaos_every, faults, chaos_actions(args))
        )
    samples = []
    while not load.done():
        await asyncio.wait([load], timeout=SAMPLE_S)
        samples.append(await sample(processes, core_address, started))
        log(f"t={samples[-1]['t_s']:.0f}s core {samples[-1].get('core')} {samples[-1]['core_stats']}")
    outcomes = load.result()
    if chaos is not None:
        await chaos
    await asyncio.sleep(args.idle)
    after = await sample(processes, core_address, started)
    report = summarize(outcomes, idle, warm, samples, after, args)
    if chaos is not None:
        report["chaos"] = judge(outcomes, faults)
        report["targets"]["no_unexpected_errors"] = report["chaos"]["errors_outside_fault_windows"] == 0
        if replicas(args) > 1:  # every expert on two workers: a worker's fault fails nothing
            worker_errors = sum(n for a, n in report["chaos"]["errors_by_fault"].items() if a != "kill_core")
            report["targets"]["worker_faults_fail_no_request"] = worker_errors == 0
        del report["targets"]["rss_growth_within_5pct"]  # restarted processes start over
        if keep_outcomes:
            report["chaos"]["fault_records"] = faults
    if keep_outcomes:
        report["outcomes"] = outcomes
    return report


def soak_up(cache: Path, up_dir: Path, args) -> dict:
    """`moe-mesh up --experts N` on the demo model (core's caches at --cache-gb), the soak against
    it, then up stopped."""
    from tests.e2e.test_up import start_up

    caches = ["--prefix-cache-gb", str(args.cache_gb), "--mlx-cache-gb", str(args.cache_gb)]
    flags = ["--experts", str(args.experts), "--served-model-name", "demo", *caches, *args.up_flags]
    proc, url = start_up(cache, up_dir, *flags)
    try:
        log(f"soak: {args.clients} clients for {args.seconds:.0f} s against {url}")
        core = f"unix:{up_dir / 'core.sock'}"
        return asyncio.run(soak(url.removesuffix("/v1"), "demo", lambda: up_processes(proc.pid), core, args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def chaos_actions(args) -> tuple[str, ...]:
    return tuple(a for a in getattr(args, "chaos_actions", ",".join(ACTIONS)).split(",") if a)


def replicas(args) -> int:
    flags = list(args.up_flags)
    return int(flags[flags.index("--replicas") + 1]) if "--replicas" in flags else 1


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


def summarize(
    outcomes: list[Outcome], idle: dict, warm: dict, samples: list[dict], after: dict, args
) -> dict:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    errors: dict[str, list[str]] = defaultdict(list)
    for o in outcomes:
        by_kind[o.kind][o.outcome] += 1
        if o.outcome not in EXPECTED and len(errors[f"{o.kind}:{o.outcome}"]) < 5:
            errors[f"{o.kind}:{o.outcome}"].append(o.detail)
    unexpected = sum(1 for o in outcomes if o.outcome not in EXPECTED)
    names = [name for name, value in idle.items() if isinstance(value, dict) and "rss_mb" in value]
    # idle after the load against idle after the warm-up: both with caches filled, nothing running
    growth = {
        n: round((after[n]["rss_mb"] - warm[n]["rss_mb"]) / warm[n]["rss_mb"] * 100, 2)
        if n in after and n in warm and after[n]["pid"] == warm[n]["pid"]
        else None
        for n in names
    }
    peak = {n: max((s[n]["rss_mb"] for s in samples if n in s), default=None) for n in names}
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    gaps = [g for o in outcomes for g in o.gaps_s]
    back = after["core_stats"]
    idle_stats = idle["core_stats"]
    targets = {
        "no_unexpected_errors": unexpected == 0,
        "rss_growth_within_5pct": all(g is not None and g <= RSS_GROWTH_LIMIT * 100 for g in growth.values()),
        "kv_and_requests_back_to_idle": back["running"] == 0
        and back["waiting"] == 0
        and back["kv_cache_bytes"] == idle_stats["kv_cache_bytes"],
        "file_descriptors_back_to_idle": all(
            after.get(n, {}).get("fds", 0) <= idle[n]["fds"] + FD_SLACK for n in names
        ),
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
        "rss_growth_pct": growth,
        "rss_mb_peak_under_load": peak,
        "after_warmup": warm,
        "idle": idle,
        "after_idle": after,
        "samples": samples,
        "targets": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument(
        "--warmup", type=float, default=120, help="seconds of load first; RSS growth counts from its idle end"
    )
    parser.add_argument(
        "--idle", type=float, default=20, help="seconds after the load before the last sample"
    )
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chaos-every",
        type=float,
        default=0,
        help="seconds between faults (kill -9 a worker, SIGSTOP one, kill -9 core: bench/soak_chaos.py)",
    )
    parser.add_argument(
        "--chaos-actions",
        default=",".join(ACTIONS),
        help="faults taken in turn, comma-separated: kill_worker, stop_worker, kill_core",
    )
    parser.add_argument(
        "--cache-gb",
        type=float,
        default=0.25,
        help="core's --prefix-cache-gb and --mlx-cache-gb: small, so both fill within the warm-up",
    )
    parser.add_argument("up_flags", nargs="*", help="more `moe-mesh up` flags (after --)")
    args = parser.parse_args()

    workdir = bench_workdir("mm-soak-")
    report = soak_up(workdir / "cache", workdir / "up", args)
    report = {
        "bench": "soak",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "model": "demo",
        "experts": args.experts,
        "clients": args.clients,
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "idle_s": args.idle,
        "chaos_every_s": args.chaos_every,
        "chaos_actions": list(chaos_actions(args)) if args.chaos_every else [],
        "replicas": replicas(args),
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        **report,
    }
    print(json.dumps(report, indent=1))
    sys.exit(0 if all(report["targets"].values()) else 1)


if __name__ == "__main__":
    main()
