"""Core and three expert workers on separate network hosts (namespaces + veth), started from one
cluster.toml with mTLS from `moe-mesh certs`.

Placement: w0 holds experts 0-3, w1 holds 4-7, w2 holds all 8 (a replica of everything), so
core spreads every layer call over the replicas. Checked: greedy tokens equal mlx-lm's own;
request ids reach the workers' logs; `cluster check` sees the running workers; SIGKILL of a
worker mid-generation is invisible to the request (identical tokens, the retry in core's
metrics) and the restarted worker is used again without restarting core; a hung worker is
bypassed within the call deadline; losing the last
owner of experts 4-7 fails the request with UNAVAILABLE naming them, health reports the gap,
and service resumes when they are back; SIGTERM drains the in-flight request.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from services.common.tls import TlsFiles
from services.proto.moemesh.v1 import core_pb2_grpc
from tests.cluster.conftest import CoreClient, oracle_tokens, write_cluster_toml
from tests.cluster.netns import NetnsLab
from tests.helpers import short_dir

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

RANGES = ["0-3", "4-7", "0-7"]
PORT = 50061
METRICS = "127.0.0.1:9191"  # inside core's namespace
PROMPT = "Once upon a time"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CLI = [sys.executable, "-m", "services.ops.cli"]


class Hosts:
    def __init__(self, lab: NetnsLab, workdir: Path, config: Path):
        self.lab, self.workdir, self.config = lab, workdir, config
        self.core_log = workdir / "core.log"
        self.worker_logs = [workdir / f"w{i}.log" for i in range(len(RANGES))]
        self.workers: list[subprocess.Popen | None] = [None] * len(RANGES)
        self.core = None
        self.client = CoreClient(
            f"unix:{workdir / 'core.sock'}", TlsFiles.in_dir(workdir / "certs", "gateway")
        )

    def address(self, i: int) -> str:
        return f"{self.lab.worker_ip(i)}:{PORT}"

    def start_worker(self, i: int) -> None:
        self.workers[i] = self.lab.spawn(
            self.lab.worker_ns[i],
            ["expert", "--config", str(self.config), "--name", f"w{i}"],
            self.worker_logs[i],
        )

    def kill_worker(self, i: int) -> None:
        self.workers[i].kill()
        self.workers[i].wait()

    def metric(self, name: str, **labels) -> float:
        text = self.lab.http_get(self.lab.core_ns, f"http://{METRICS}/metrics")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    async def wait_metric(self, name: str, value: float, timeout_s: float = 30.0, **labels) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.metric(name, **labels) == value:
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"{name}{labels} never became {value}: {self.core_log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def hosts(netns_ok, tiny_models):
    workdir = short_dir()
    split = tiny_models.split("qwen3_moe", None)
    with NetnsLab(workers=len(RANGES)) as lab:
        config = write_cluster_toml(
            workdir / "cluster.toml",
            split,
            f"unix:{workdir / 'core.sock'}",
            [(f"w{i}", f"{lab.worker_ip(i)}:{PORT}", r) for i, r in enumerate(RANGES)],
            tls_dir="certs",
            core_metrics=METRICS,
            worker_metrics=METRICS,  # each worker in its own namespace: same port, no clash
        )
        made = subprocess.run(
            [*CLI, "certs", "--config", str(config)], check=False, capture_output=True, text=True
        )
        assert made.returncode == 0, made.stderr
        hosts = Hosts(lab, workdir, config)
        for i in range(len(RANGES)):
            hosts.start_worker(i)
        hosts.core = lab.spawn(lab.core_ns, ["core", "--config", str(config)], hosts.core_log)
        yield hosts
    shutil.rmtree(workdir, ignore_errors=True)


async def test_greedy_tokens_across_hosts_equal_mlx_lm(hosts, tiny_models):
    ids, want = oracle_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 16)
    await hosts.client.wait_health(SERVING, log=hosts.core_log)
    assert await hosts.client.tokens(hosts.client.request(ids, 16, request_id="netns-req-7f3a")) == want
    for i, log in enumerate(hosts.worker_logs):  # every worker served part of it and logged the id
        text = log.read_text()
        seen = [json.loads(line) for line in text.splitlines() if '"request_seen"' in line]
        assert any(entry["request_id"] == "netns-req-7f3a" for entry in seen), text[-1500:]
        assert "insecure_bind" not in text  # mTLS: no warning
        assert hosts.metric("moe_mesh_expert_worker_calls_total", worker=hosts.address(i)) > 0
        worker_metrics = hosts.lab.http_get(hosts.lab.worker_ns[i], f"http://{METRICS}/metrics")
        assert "python_info" in worker_metrics  # the worker's own endpoint (cache metrics: #5's)


def test_cluster_check_sees_the_running_workers(hosts):
    done = subprocess.run(
        ["ip", "netns", "exec", hosts.lab.core_ns, *CLI, "cluster", "check", "--config", str(hosts.config)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for i in range(len(RANGES)):
        assert f"worker w{i} is up with fingerprint" in done.stdout


async def test_worker_killed_mid_generation_is_invisible_and_comes_back(hosts, tiny_models):
    ids, want = oracle_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 40)
    client = hosts.client
    await client.wait_health(SERVING, log=hosts.core_log)
    replica = hosts.address(2)
    retries_before = hosts.metric("moe_mesh_expert_worker_retries_total", worker=replica)
    async with client.channel() as channel:
        call = core_pb2_grpc.CoreStub(channel).Generate(client.request(ids, 40), timeout=60)
        got = []
        for _ in range(3):
            got.extend((await call.read()).token_ids)
        hosts.kill_worker(2)
        while (chunk := await call.read()) is not grpc.aio.EOF:
            got.extend(chunk.token_ids)
    assert got == want
    assert hosts.metric("moe_mesh_expert_worker_retries_total", worker=replica) > retries_before
    assert hosts.metric("moe_mesh_expert_worker_up", worker=replica) == 0
    assert await client.health() == SERVING  # w0 + w1 still cover every expert

    calls_before = hosts.metric("moe_mesh_expert_worker_calls_total", worker=replica)
    hosts.start_worker(2)
    await hosts.wait_metric("moe_mesh_expert_worker_up", 1, worker=replica)  # reconnected, core untouched
    assert await client.tokens(client.request(ids, 40)) == want
    assert hosts.metric("moe_mesh_expert_worker_calls_total", worker=replica) > calls_before
    assert hosts.core.poll() is None


async def test_hung_replica_is_bypassed_within_the_call_deadline(hosts, tiny_models):
    """A worker that stops answering (SIGSTOP: a Mac gone to sleep) gets half of the 10 s call
    deadline, then its pairs go to the other replica: same tokens, no error."""
    ids, want = oracle_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 16)
    client = hosts.client
    replica = hosts.address(2)
    await hosts.wait_metric("moe_mesh_expert_worker_up", 1, worker=replica)
    async with client.channel() as channel:
        call = core_pb2_grpc.CoreStub(channel).Generate(client.request(ids, 16), timeout=60)
        got = list((await call.read()).token_ids)
        hosts.workers[2].send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            while (chunk := await call.read()) is not grpc.aio.EOF:
                got.extend(chunk.token_ids)
            assert time.monotonic() - started < 10
        finally:
            hosts.workers[2].send_signal(signal.SIGCONT)
    assert got == want
    assert hosts.metric("moe_mesh_expert_worker_errors_total", worker=replica, code="UNAVAILABLE") > 0
    await hosts.wait_metric("moe_mesh_expert_worker_up", 1, worker=replica)  # back after SIGCONT


async def test_last_owner_lost_fails_with_the_missing_experts_then_recovers(hosts, tiny_models):
    ids, want = oracle_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 16)
    client = hosts.client
    await client.wait_health(SERVING, log=hosts.core_log)
    await hosts.wait_metric("moe_mesh_expert_worker_up", 1, worker=hosts.address(2))
    hosts.kill_worker(2)  # experts 4-7 now live on w1 only
    async with client.channel() as channel:
        call = core_pb2_grpc.CoreStub(channel).Generate(client.request(ids, 3000), timeout=60)
        for _ in range(3):
            await call.read()
        hosts.kill_worker(1)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            while (await call.read()) is not grpc.aio.EOF:
                pass
    assert time.monotonic() - started < 10  # within the 10 s expert timeout, not at it
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    details = failure.value.details()
    assert hosts.address(1) in details and "have no reachable worker" in details, details
    await client.wait_health(NOT_SERVING)
    problems = list((await client.stats()).problems)
    gaps = [p for p in problems if "have no reachable worker" in p]
    assert gaps and all("experts 4-7 have" in p for p in gaps), problems  # every MoE layer, exactly 4-7

    hosts.start_worker(1)
    await client.wait_health(SERVING, log=hosts.core_log)
    assert list((await client.stats()).problems) == []
    assert await client.tokens(client.request(ids, 16)) == want
    hosts.start_worker(2)
    assert hosts.core.poll() is None


async def test_sigterm_drains_the_in_flight_request(hosts):
    """Health turns NOT_SERVING first, the running request still completes, then core exits 0."""
    client = hosts.client
    await client.wait_health(SERVING, log=hosts.core_log)
    async with client.channel() as channel:
        call = core_pb2_grpc.CoreStub(channel).Generate(client.request([1, 2, 3], 60), timeout=60)
        first = await call.read()
        hosts.core.send_signal(signal.SIGTERM)
        await client.wait_health(NOT_SERVING, timeout_s=5)
        rest = []
        while (chunk := await call.read()) is not grpc.aio.EOF:
            rest.append(chunk)
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 60
    code = await asyncio.to_thread(hosts.core.wait, 30)
    assert code == 0, hosts.core_log.read_text()[-3000:]
    assert '"event": "draining"' in hosts.core_log.read_text()
