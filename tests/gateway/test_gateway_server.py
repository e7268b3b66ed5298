"""`run_gateway` as a process: serves, logs JSON lines only, and exits cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port

from .core_double import MODEL_ID, CoreDouble

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_run_gateway_serves_logs_json_and_stops_on_sigterm(core_server, core: CoreDouble) -> None:
    port = free_port()
    code = f"from services.gateway.server import run_gateway; run_gateway('127.0.0.1', {port}, {core_server.target!r})"
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).json() == {"status": "ok", "core": "SERVING"}:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "gateway did not come up"
            time.sleep(0.1)
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "proc-1"})
        assert response.status_code == 200
        assert "server" not in response.headers  # no version banner
        # A request that fails in core logs a warning: it must carry the request id too.
        failing = httpx.post(
            url + "/v1/chat/completions", json={**body, "model": "other"}, headers={"X-Request-Id": "proc-2"}
        )
        assert failing.status_code == 404
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=20)
    # uvicorn shuts down gracefully, then re-raises the signal so a supervisor sees why it ended
    # (systemd counts SIGTERM as a clean exit).
    assert process.returncode in (0, -signal.SIGTERM), stderr
    lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is JSON
    assert all(record["service"] == "gateway" for record in records)
    assert any(
        record.get("request_id") == "proc-1" and record["event"] == "chat completion" for record in records
    )
    assert any(
        record.get("request_id") == "proc-2" and record["event"] == "core call failed" for record in records
    )
    # Every line a request causes names it; only lifecycle lines (start, stop) have no request id.
    lifecycle = (
        "gateway started",
        "Started server",
        "Waiting for",
        "Application",
        "Uvicorn running",
        "Shutting down",
        "Finished server",
    )
    unnamed = [r["event"] for r in records if "request_id" not in r and not r["event"].startswith(lifecycle)]
    assert unnamed == [], unnamed
    assert not any("GET /health" in record["event"] for record in records)  # no access log at info
    assert any(record["event"] == "Application shutdown complete." for record in records)


@pytest.mark.slow
def test_cli_api_keys_from_flag_file_and_env(core_server, core: CoreDouble, tmp_path: Path) -> None:
    port = free_port()
    key_file = tmp_path / "keys"
    key_file.write_text("sk-from-file\n")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.ops.cli",
            "--log-level",
            "warning",
            "gateway",
            "--core",
            core_server.target,
        ]
        + ["--port", str(port), "--api-key", "sk-from-flag", "--api-key-file", str(key_file)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MOE_MESH_API_KEY": "sk-from-env"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:  # probes need no key
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "gateway did not come up"
            time.sleep(0.1)
        models = url + "/v1/models"
        for key in ("sk-from-flag", "sk-from-file", "sk-from-env"):
            assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}).status_code == 200, key
        assert httpx.get(models).status_code == 401
        assert httpx.get(models, headers={"Authorization": "Bearer sk-from"}).status_code == 401
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=20)
