"""Core's and the workers' memory stays within what they were given under load: streaming clients
that disconnect at random for a while, then idle. Core's RSS may grow from its idle start by at most
its prefix-cache and MLX buffer-cache budgets (plus the KV of the sequences running at the moment,
none once idle); a worker's, whose experts are resident from the start, by its MLX buffer cache."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.e2e.test_up import service_pids, start_up
from tests.helpers import short_dir

BUDGET_GB = 0.05  # --prefix-cache-gb and --mlx-cache-gb each
SLACK_MB = 120  # allocator and interpreter noise

pytestmark = pytest.mark.slow


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


async def chat_client(url: str, stop_at: float, rng: random.Random) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < stop_at:
            words = " ".join(
                rng.choice(["river", "stone", "Paris", "code", "light"]) for _ in range(rng.randint(5, 150))
            )
            body = {
                "model": "demo",
                "messages": [{"role": "user", "content": words}],
                "max_tokens": rng.randint(8, 48),
                "stream": True,
            }
            cut_after = rng.randint(1, 10) if rng.random() < 0.3 else None
            async with client.stream("POST", f"{url}/chat/completions", json=body) as reply:
                assert reply.status_code in (200, 429)
                lines = 0
                async for _ in reply.aiter_lines():
                    lines += 1
                    if cut_after is not None and lines > cut_after:
                        break  # the client goes away mid-stream


def test_core_memory_stays_within_its_budgets_under_load(tmp_path):
    budgets = ["--prefix-cache-gb", str(BUDGET_GB), "--mlx-cache-gb", str(BUDGET_GB)]
    proc, url = start_up(
        tmp_path / "cache", short_dir("mm-mem-"), "--experts", "1", "--served-model-name", "demo", *budgets
    )
    try:
        core = service_pids(proc.pid, "core")[0]
        workers = service_pids(proc.pid, "expert")
        assert workers and any("--mlx-cache-gb" in open(f"/proc/{w}/cmdline").read() for w in workers)
        idle = rss_mb(core)
        workers_idle = {w: rss_mb(w) for w in workers}

        async def load():
            stop_at = time.monotonic() + 15
            await asyncio.gather(*(chat_client(url, stop_at, random.Random(i)) for i in range(8)))

        asyncio.run(load())
        time.sleep(3)
        grown = rss_mb(core) - idle
        print(f"core idle {idle:.0f} MB, grown {grown:.0f} MB")
        assert grown <= 2 * BUDGET_GB * 1024 + SLACK_MB, f"core grew {grown:.0f} MB from {idle:.0f} MB idle"
        for (
            worker,
            was,
        ) in workers_idle.items():  # its experts are resident from the start: only its cache grows
            worker_grown = rss_mb(worker) - was
            print(f"worker idle {was:.0f} MB, grown {worker_grown:.0f} MB")
            assert worker_grown <= BUDGET_GB * 1024 + SLACK_MB, f"a worker grew {worker_grown:.0f} MB"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
