"""45 s of mixed traffic against `moe-mesh up --experts 3` (bench/soak.py runs it for ten minutes):
no error but 429s and the clients' own cancels, and once the load stops core holds no request
and no KV cache, and no process holds more file descriptors than it did idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.soak import soak_up
from bench.soak_link import soak_slow_link
from tests.helpers import short_dir

pytestmark = pytest.mark.slow


def test_mixed_traffic_leaves_nothing_behind(tmp_path):
    args = SimpleNamespace(
        clients=12, seconds=45, warmup=0, idle=5, seed=0, experts=3, cache_gb=0.1, up_flags=[]
    )
    report = soak_up(tmp_path / "cache", short_dir("mm-soak-"), args)
    print({k: report[k] for k in ("requests", "outcomes_by_kind", "ttft_ms", "rss_mb_peak_under_load")})
    assert report["unexpected_errors"] == 0, report["error_examples"]
    kinds = report["outcomes_by_kind"]
    assert len(kinds) >= 8 and all(sum(counts.values()) for counts in kinds.values()), kinds
    assert report["targets"]["kv_and_requests_back_to_idle"], (report["idle"], report["after_idle"])
    assert report["targets"]["file_descriptors_back_to_idle"], (report["idle"], report["after_idle"])


def test_with_two_replicas_a_worker_killed_or_stopped_fails_no_request(tmp_path):
    """Every expert on both workers: kill -9 one, later SIGSTOP one for 5 s, under load."""
    args = SimpleNamespace(
        clients=4, seconds=32, warmup=0, idle=3, seed=1, experts=2, cache_gb=0.1,
        chaos_every=10, chaos_actions="kill_worker,stop_worker", up_flags=["--replicas", "2"],
    )  # fmt: skip
    report = soak_up(tmp_path / "cache", short_dir("mm-soak-"), args)
    chaos = report["chaos"]
    print({k: report[k] for k in ("requests", "outcomes_by_kind")}, chaos)
    assert [f["action"] for f in chaos["faults"]] == ["kill_worker", "stop_worker"], chaos
    assert report["requests"] >= 4
    assert report["unexpected_errors"] == 0, report["error_examples"]  # none at all, in or out of the faults
    assert report["targets"]["worker_faults_fail_no_request"], chaos


def test_a_worker_link_slowed_by_50_ms_fails_no_request(tmp_path):
    """The first worker reached through a relay that adds 50 ms each way for 10 s, twice, with
    connections kept open (bench/soak_link.py): requests slow down and none fails."""
    args = SimpleNamespace(
        clients=3, seconds=30, warmup=0, idle=3, seed=2, experts=2, cache_gb=0.1, chaos_every=8, up_flags=[]
    )
    report = soak_slow_link(tmp_path / "cache", short_dir("mm-soak-link-"), args)
    chaos, by_link = report["chaos"], report["by_link"]
    print({k: report[k] for k in ("requests", "outcomes_by_kind")}, chaos, by_link)
    assert [f["action"] for f in chaos["faults"]] == ["delay_link", "delay_link"], chaos
    assert by_link["overlapped_slow_link"]["requests"] >= 1, by_link  # the delay met live requests
    assert report["unexpected_errors"] == 0, report["error_examples"]
    assert report["targets"]["kv_and_requests_back_to_idle"], (report["idle"], report["after_idle"])
