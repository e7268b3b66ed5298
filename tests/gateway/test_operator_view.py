"""The operator's view over real processes: the status data, one scrape target for every
service, and errors that name what is missing when a worker is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.manifest import Manifest
from tests.helpers import Workers, core_args, short_dir, spawn, stop, wait_serving

from .conftest import GatewayThread

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4}


class TwoWorkerStack:
    """Two workers (half the experts each), a core over them (10 s expert timeout), a gateway."""

    def __init__(self, split: Path) -> None:
        self.workdir = short_dir("mm-ov-")
        experts = Manifest.load(split).num_experts
        half = experts // 2
        self.ranges = [f"0-{half - 1}", f"{half}-{experts - 1}"]
        self.workers = Workers(split, self.workdir, self.ranges).start()
        self.core_address = f"unix:{self.workdir / 'core.sock'}"
        self.core_log = self.workdir / "core.log"
        args = core_args(split, self.core_address, self.workers.addresses, "--expert-timeout", "10")
        self.core = spawn(args, self.core_log)
        wait_serving(self.core_address, self.core, log_path=self.core_log)
        self.gateway = GatewayThread(self.core_address).start()
        self.url = self.gateway.url

    def status(self) -> dict:
        return httpx.get(self.url + "/status.json", timeout=10).json()

    def close(self) -> None:
        self.gateway.stop()
        stop([self.core])
        self.workers.stop()


@pytest.fixture(scope="module")
def stack(tiny_models):
    stack = TwoWorkerStack(tiny_models.split("qwen3_moe", None))
    yield stack
    stack.close()


def wait_for(predicate, timeout_s: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_status_json_maps_the_cluster_and_times_each_layer(stack):
    reply = httpx.post(stack.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert reply.status_code == 200, reply.text
    status = stack.status()
    assert status["core"]["state"] == "serving" and status["core"]["problems"] == []
    assert status["core"]["speculative"] is None  # this core does not speculate
    assert status["core"]["generation_tokens_total"] >= 1
    assert 0 < status["core"]["kv_cache_capacity_bytes"]
    assert status["core"]["mlx_active_bytes"] > 0  # core's weights are MLX arrays
    workers = {w["address"]: w for w in status["workers"]}
    assert set(workers) == set(stack.workers.addresses)
    for address, experts in zip(stack.workers.addresses, stack.ranges, strict=True):
        worker = workers[address]
        assert worker["up"] and worker["experts"] == experts and worker["min_replicas"] == 1
        assert worker["resident_bytes"] > 0 and worker["calls"] > 0 and worker["host"] == "this host"
    layers = status["layers"]
    assert layers and all(entry["calls"] > 0 and 0 < entry["p50_us"] <= entry["p99_us"] for entry in layers)


def status_cli(stack) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.ops.cli", "status", "--url", stack.url],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_command_prints_the_cluster(stack):
    shown = status_cli(stack)
    assert shown.returncode == 0, shown.stderr
    assert "core serving" in shown.stdout
    for address, experts in zip(stack.workers.addresses, stack.ranges, strict=True):
        row = next(line for line in shown.stdout.splitlines() if address in line)
        assert " up " in row and experts in row, row


def test_metrics_relay_core_and_every_worker(stack):
    httpx.post(stack.url + "/v1/chat/completions", json=CHAT, timeout=60)
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    assert "vllm:kv_cache_usage_perc{" in text and "moe_mesh_prefix_cache_hits{" in text
    assert "moe_mesh_expert_layer_call_seconds_bucket{" in text and 'service="core"' in text
    for address in stack.workers.addresses:
        assert f'moe_mesh_service_scrape_up{{service="expert",worker="{address}"}} 1.0' in text
        assert f'moe_mesh_expert_resident_bytes{{service="expert",worker="{address}"}}' in text


def test_a_lost_worker_is_named_in_the_503_ready_and_status(stack):
    stack.workers.kill(1)
    try:
        missing = stack.ranges[1]
        # a request fails at its first layer call (or is refused at once once core knows)
        reply = httpx.post(stack.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        assert stack.workers.addresses[1] in message, message

        def not_ready():
            ready = httpx.get(stack.url + "/ready", timeout=10)
            return ready if ready.status_code == 503 and "have no reachable worker" in ready.text else None

        ready = wait_for(not_ready, what="/ready names the gap")
        detail = ready.json()["error"]["message"]
        assert f"experts {missing} have no reachable worker (last served by" in detail, detail
        assert stack.workers.addresses[1] in detail, detail
        assert httpx.get(stack.url + "/health", timeout=10).status_code == 200  # liveness only

        refused = httpx.post(stack.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert refused.status_code == 503
        assert f"experts {missing} have no reachable worker" in refused.json()["error"]["message"]

        status = stack.status()
        assert status["core"]["state"] == "not_serving" and status["core"]["problems"]
        down = next(w for w in status["workers"] if w["address"] == stack.workers.addresses[1])
        assert not down["up"] and down["last_error"] and down["experts"] == missing
        shown = status_cli(stack)
        assert shown.returncode == 1 and "DOWN" in shown.stdout and "no reachable worker" in shown.stdout
    finally:
        stack.workers.ensure_running()
    wait_for(lambda: httpx.get(stack.url + "/ready", timeout=10).status_code == 200, what="ready again")


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
METRIC_NAME = re.compile(r"\b(vllm:[a-z_:]+|moe_mesh_[a-z_]+)")


def dashboard_metrics() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {
        name
        for panel in panels
        for target in panel["targets"]
        for name in METRIC_NAME.findall(target["expr"])
    }


def test_every_metric_the_grafana_dashboard_uses_is_scraped_from_the_gateway(stack):
    httpx.post(stack.url + "/v1/chat/completions", json=CHAT, timeout=60)
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    names = dashboard_metrics()
    assert len(names) >= 15, names  # the parse found the dashboard's series
    exposed = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    declared = {
        line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")
    }  # none counted yet
    missing = sorted(n for n in names if n not in exposed and n not in declared)
    assert not missing, missing


def test_a_stalled_core_ends_the_request_at_the_gateways_deadline(stack):
    """Stall the gateway-to-core hop (core SIGSTOPped mid-request): the client gets an error at the
    gateway's deadline, streamed or not, rather than waiting for ever; core serves on after SIGCONT."""
    gateway = GatewayThread(stack.core_address, generate_timeout_s=4.0, unary_timeout_s=2.0).start()
    try:
        long = {**CHAT, "max_tokens": 4000, "ignore_eos": True}
        os.kill(stack.core.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            reply = httpx.post(gateway.url + "/v1/chat/completions", json=long, timeout=60)
            assert reply.status_code == 504, reply.text
            assert (
                reply.json()["error"]["message"]
                == "the model server (core) did not answer within the deadline"
            )
            with httpx.stream(
                "POST", gateway.url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60
            ) as stream:
                body = "".join(stream.iter_text())
            assert '"error"' in body and "did not answer within the deadline" in body, body[-500:]
            assert time.monotonic() - started < 20
        finally:
            os.kill(stack.core.pid, signal.SIGCONT)
        assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    finally:
        gateway.stop()


def test_status_json_carries_speculation_when_core_drafts():
    from services.gateway.status_view import core_json
    from services.proto.moemesh.v1 import core_pb2

    stats = core_pb2.CoreStats()
    stats.speculative.method = "ngram"
    stats.speculative.drafts, stats.speculative.draft_tokens, stats.speculative.accepted_tokens = 3, 8, 6
    spec = core_json(stats, "SERVING", "unix:/core")["speculative"]
    assert spec == {
        "method": "ngram",
        "drafts": 3,
        "draft_tokens": 8,
        "accepted_tokens": 6,
        "acceptance_rate": 0.75,
    }
