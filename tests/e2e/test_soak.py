"""A minute of mixed traffic against `moe-mesh up --experts 3` (bench/soak.py runs it for ten):
no error but 429s and the clients' own cancels, and once the load stops core holds no request
and no KV cache, and no process holds more file descriptors than it did idle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from bench.soak import soak, up_processes
from tests.e2e.test_up import start_up
from tests.helpers import short_dir

pytestmark = pytest.mark.slow


def test_a_minute_of_mixed_traffic_leaves_nothing_behind(tmp_path):
    up_dir = short_dir("mm-soak-")
    budgets = ["--prefix-cache-gb", "0.1", "--mlx-cache-gb", "0.1"]
    proc, url = start_up(
        tmp_path / "cache", up_dir, "--experts", "3", "--served-model-name", "demo", *budgets
    )
    try:
        args = SimpleNamespace(clients=16, seconds=60, warmup=0, idle=5, seed=0)
        core = f"unix:{up_dir / 'core.sock'}"
        report = asyncio.run(
            soak(url.removesuffix("/v1"), "demo", lambda: up_processes(proc.pid), core, args)
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print({k: report[k] for k in ("requests", "outcomes_by_kind", "ttft_ms", "rss_growth_after_warmup_pct")})
    assert report["unexpected_errors"] == 0, report["error_examples"]
    kinds = report["outcomes_by_kind"]
    assert len(kinds) >= 8 and all(sum(counts.values()) for counts in kinds.values()), kinds
    assert report["targets"]["kv_and_requests_back_to_idle"], (report["idle"], report["after_idle"])
    assert report["targets"]["file_descriptors_back_to_idle"], (report["idle"], report["after_idle"])
