"""Core and three expert workers on separate network hosts (namespaces + veth), started from a
cluster.toml: greedy tokens equal mlx-lm's own; request ids reach the workers' logs; a worker
lost without a replica fails requests with UNAVAILABLE naming the missing experts, health
reports the gap, and the restarted worker is used again without restarting core; SIGTERM
drains the in-flight request before core exits."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.proto.moemesh.v1 import core_pb2_grpc
from tests.cluster.conftest import CoreClient, oracle_tokens, write_cluster_toml
from tests.cluster.netns import NetnsLab

RANGES = ["0-2", "3-5", "6-7"]
PORT = 50061
PROMPT = "Once upon a time"


class ThreeHosts:
    def __init__(self, lab: NetnsLab, workdir: Path, config: Path):
        self.lab, self.workdir, self.config = lab, workdir, config
        self.core_address = f"unix:{workdir / 'core.sock'}"
        self.core_log = workdir / "core.log"
        self.worker_logs = [workdir / f"w{i}.log" for i in range(len(RANGES))]
        self.workers: list[subprocess.Popen | None] = [None] * len(RANGES)
        self.core = None
        self.client = CoreClient(self.core_address)

    def start_worker(self, i: int) -> None:
        self.workers[i] = self.lab.spawn(
            self.lab.worker_ns[i], ["expert", "--config", str(self.config), "--name", f"w{i}"], self.worker_logs[i]
        )

    def wait_worker(self, i: int) -> None:
        self.lab.wait_port(self.lab.worker_ns[i], self.lab.worker_ip(i), PORT, self.workers[i], self.worker_logs[i])


@pytest.fixture(scope="module")
def hosts(netns_ok, tiny_models):
    workdir = Path(tempfile.mkdtemp(prefix="mm-", dir="/tmp"))
    split = tiny_models.split("qwen3_moe", None)
    with NetnsLab(workers=len(RANGES)) as lab:
        config = write_cluster_toml(
            workdir / "cluster.toml",
            split,
            f"unix:{workdir / 'core.sock'}",
            [(f"w{i}", f"{lab.worker_ip(i)}:{PORT}", r) for i, r in enumerate(RANGES)],
        )
        hosts = ThreeHosts(lab, workdir, config)
        for i in range(len(RANGES)):
            hosts.start_worker(i)
        hosts.core = lab.spawn(lab.core_ns, ["core", "--config", str(config)], hosts.core_log)
        yield hosts
    shutil.rmtree(workdir, ignore_errors=True)


async def test_greedy_tokens_across_hosts_equal_mlx_lm(hosts, tiny_models):
    ids, want = oracle_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 16)
    await hosts.client.wait_health(health_pb2.HealthCheckResponse.SERVING, log=hosts.core_log)
    assert await hosts.client.tokens(hosts.client.request(ids, 16, request_id="netns-req-7f3a")) == want
    for log in hosts.worker_logs:  # every worker served part of it and logged the request id
        seen = [json.loads(line) for line in log.read_text().splitlines() if "request_seen" in line]
        assert any(entry["request_id"] == "netns-req-7f3a" for entry in seen), log.read_text()[-1500:]
        # each worker listens on a non-loopback address without TLS: it says so
        assert "insecure_bind" in log.read_text()


def test_cluster_check_sees_the_running_workers(hosts):
    done = subprocess.run(
        ["ip", "netns", "exec", hosts.lab.core_ns, *_cli(), "cluster", "check", "--config", str(hosts.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for i in range(len(RANGES)):
        assert f"worker w{i} is up with fingerprint" in done.stdout


async def test_lost_worker_without_replica_then_back_without_core_restart(hosts, tiny_models):
    ids, want = oracle_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 16)
    client = hosts.client
    await client.wait_health(health_pb2.HealthCheckResponse.SERVING, log=hosts.core_log)
    async with client.channel() as channel:
        call = core_pb2_grpc.CoreStub(channel).Generate(client.request(ids, 3000), timeout=60)
        for _ in range(3):
            await call.read()
        hosts.workers[1].kill()
        hosts.workers[1].wait()
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            while (await call.read()) is not grpc.aio.EOF:
                pass
    assert time.monotonic() - started < 10  # well within the 10 s expert timeout
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    details = failure.value.details()
    assert f"{hosts.lab.worker_ip(1)}:{PORT}" in details and "have no reachable worker" in details, details
    await client.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    problems = list((await client.stats()).problems)
    gaps = [p for p in problems if "have no reachable worker" in p]
    assert gaps and all("experts 3-5 have" in p for p in gaps), problems  # every MoE layer, exactly 3-5
    assert any(f"{hosts.lab.worker_ip(1)}:{PORT} is unreachable" in p for p in problems), problems

    hosts.start_worker(1)
    await client.wait_health(health_pb2.HealthCheckResponse.SERVING, log=hosts.core_log)
    assert list((await client.stats()).problems) == []
    assert await client.tokens(client.request(ids, 16)) == want
    assert hosts.core.poll() is None


async def test_sigterm_drains_the_in_flight_request(hosts):
    """Health turns NOT_SERVING first, the running request still completes, then core exits 0."""
    client = hosts.client
    await client.wait_health(health_pb2.HealthCheckResponse.SERVING, log=hosts.core_log)
    async with client.channel() as channel:
        call = core_pb2_grpc.CoreStub(channel).Generate(client.request([1, 2, 3], 60), timeout=60)
        first = await call.read()
        hosts.core.send_signal(signal.SIGTERM)
        await client.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=5)
        rest = []
        while (chunk := await call.read()) is not grpc.aio.EOF:
            rest.append(chunk)
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 60
    assert await asyncio.to_thread(hosts.core.wait, 30) == 0
    assert '"event": "draining"' in hosts.core_log.read_text()


def _cli() -> list[str]:
    import sys

    return [sys.executable, "-m", "services.cli"]
