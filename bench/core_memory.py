"""Core's memory under streaming load: RSS over time, and after the load stops.

    python bench/core_memory.py [--clients 24] [--seconds 60] [--idle 15] [--experts 3] [-- UP FLAGS]

Starts `moe-mesh up` on the demo model, runs N chat clients that stream answers and disconnect at
random (30 % of requests, after 1-10 lines) for the given time, samples core's RSS every 5 s, then
again after the idle time. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import log
from bench.workdir import bench_workdir
from tests.e2e.test_memory_bound import chat_client, rss_mb
from tests.e2e.test_up import service_pids, start_up


async def sample_under_load(url: str, core: int, clients: int, seconds: float) -> list[dict]:
    stop_at = time.monotonic() + seconds
    load = asyncio.gather(*(chat_client(url, stop_at, random.Random(i)) for i in range(clients)))
    started, samples = time.monotonic(), []
    while not load.done():
        await asyncio.sleep(5)
        samples.append({"t_s": round(time.monotonic() - started), "core_rss_mb": round(rss_mb(core))})
    await load
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--idle", type=float, default=15)
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("up_flags", nargs="*", help="more `moe-mesh up` flags (after --)")
    args = parser.parse_args()
    workdir = bench_workdir("mm-mem-")
    proc, url = start_up(
        workdir / "cache",
        workdir / "up",
        "--experts",
        str(args.experts),
        "--served-model-name",
        "demo",
        *args.up_flags,
    )
    try:
        core = service_pids(proc.pid, "core")[0]
        idle = round(rss_mb(core))
        log(f"core idle at {idle} MB; {args.clients} clients for {args.seconds:.0f} s")
        samples = asyncio.run(sample_under_load(url, core, args.clients, args.seconds))
        time.sleep(args.idle)
        report = {
            "bench": "core_memory",
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
            "model": "demo",
            "experts": args.experts,
            "clients": args.clients,
            "seconds": args.seconds,
            "up_flags": args.up_flags,
            "core_rss_mb_idle": idle,
            "core_rss_mb_under_load": samples,
            "core_rss_mb_peak": max(s["core_rss_mb"] for s in samples),
            f"core_rss_mb_after_{args.idle:.0f}s_idle": round(rss_mb(core)),
            "command": "python bench/core_memory.py " + " ".join(sys.argv[1:]),
        }
        print(json.dumps(report, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
