"""What an operator reads: up's relayed lines and kept logs, core's stats line, the log format,
`moe-mesh status`, and the status page behind API keys."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from datetime import datetime

import pytest
from fastapi.testclient import TestClient

from services.core.stats_line import _Totals, stats_fields
from services.gateway.app import create_app
from services.ops.status_cli import render
from services.ops.up_console import LogRelay, new_log_dir, prune_log_dirs, readable, stats_text
from services.proto.moemesh.v1 import core_pb2


def test_relay_prints_progress_stats_and_errors_not_chatter(tmp_path):
    log = tmp_path / "expert-0.log"
    log.write_text(json.dumps({"event": "old", "level": "error"}) + "\n")  # before following: not relayed
    out = io.StringIO()
    relay = LogRelay(out=out)
    relay.follow("expert-0", log)
    lines = [
        {
            "event": "load",
            "stage": "weights_read",
            "done": 3,
            "total": 30,
            "unit": "layers",
            "gb": 1.5,
            "seconds": 2.0,
        },
        {"event": "forward_stream_open", "level": "info"},
        {"event": "stats", "level": "info", "generation_tok_s": 35.2, "running": 3, "hop_p50_us": 812},
        {"event": "call_failed", "level": "error", "error": "boom"},
    ]
    with open(log, "a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines) + '{"event": "load", "sta')  # half a line
    relay.relay_once()
    text = out.getvalue().splitlines()
    assert text == [
        "[expert-0] weights read 3/30 layers 1.5 GB (2.0 s)",
        "[expert-0] prompt 0 tok/s, generation 35.2 tok/s, running 3, waiting 0, KV -, prefix hits -, hop p50 812 us",
        "[expert-0] error call_failed error=boom",
    ]
    with open(log, "a") as f:
        f.write('ge": "serving", "address": "unix:/x.sock"}\n')  # the rest of that line arrives
    relay.relay_once()
    assert out.getvalue().splitlines()[-1] == "[expert-0] serving address unix:/x.sock"


def test_relay_passes_json_lines_through_when_up_logs_json(tmp_path):
    log = tmp_path / "core.log"
    log.write_text("")
    out = io.StringIO()
    relay = LogRelay(as_json=True, out=out)
    relay.follow("core", log)
    event = {"event": "load", "stage": "kernels_ready", "service": "core"}
    log.write_text(json.dumps(event) + "\n" + json.dumps({"event": "noise"}) + "\n")
    relay.relay_once()
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [{**event, "process": "core"}]
    assert readable("core", {"event": "noise", "level": "warning"}) is None


def test_log_dirs_are_new_per_run_and_pruned_to_a_bound(tmp_path):
    root = tmp_path / "logs"
    made = [new_log_dir(root, keep=3) for _ in range(5)]
    assert len(set(made)) == 5
    assert set(root.iterdir()) == set(made[-3:])  # the newest three, by start
    assert prune_log_dirs(root, 1) == made[-3:-1]


def test_runs_in_one_millisecond_never_reuse_a_pruned_name(tmp_path, monkeypatch):
    import services.ops.up_console as up_console

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5, 678000)

    monkeypatch.setattr(up_console, "datetime", Frozen)
    root = tmp_path / "logs"
    made = [new_log_dir(root, keep=3) for _ in range(12)]
    assert len(set(made)) == 12
    assert made[0].name == "2026-01-02_03-04-05.678" and made[11].name == "2026-01-02_03-04-05.678_12"
    assert set(root.iterdir()) == set(made[-3:])  # _10.._12 outlive _9 though "_9" > "_10" as text


def test_stats_line_reports_the_interval_and_stays_quiet_when_idle():
    stats = core_pb2.CoreStats(running_requests=2, kv_cache_bytes=25, kv_cache_capacity_bytes=100)
    stats.layer_latency.add(layer=0, calls=3, p50_us=800)
    stats.layer_latency.add(layer=1, calls=3, p50_us=1200)
    stats.workers.add(address="unix:/a", up=True)
    stats.workers.add(address="unix:/b", worker_id="expert-1", up=False)
    before = _Totals(
        at=0.0, prompt=0, generation=0, lookups=0, hits=0, cache_hits=0, cache_misses=0, bytes_read=0
    )
    now = _Totals(
        at=10.0, prompt=100, generation=350, lookups=4, hits=1, cache_hits=90, cache_misses=10, bytes_read=2e9
    )
    fields = stats_fields(stats, now, before)
    assert fields == {
        "prompt_tok_s": 10.0,
        "generation_tok_s": 35.0,
        "running": 2,
        "waiting": 0,
        "kv_cache_pct": 25.0,
        "prefix_cache_hit_pct": 25.0,
        "hop_p50_us": 1200,
        "expert_cache_hit_pct": 90.0,
        "ssd_gb_s": 0.2,
        "workers_down": ["expert-1"],
    }
    assert stats_fields(core_pb2.CoreStats(), before, before) is None  # idle: no line
    assert "draft_acceptance_pct" not in fields  # core does not speculate
    stats.speculative.method = "ngram"
    now.draft_tokens, now.accepted_tokens = 40, 30
    fields = stats_fields(stats, now, before)
    assert fields["draft_acceptance_pct"] == 75.0
    assert "drafts accepted 75.0%" in stats_text({"event": "stats", **fields})


@pytest.mark.slow
def test_log_format_follows_the_terminal_unless_told():
    code = (
        "import sys; from services.common.logging import configure_logging, get_logger; "
        "configure_logging('t', 'info', sys.argv[1]); get_logger().info('hello', n=1)"
    )
    json_line = subprocess.run(
        [sys.executable, "-c", code, "auto"], check=False, capture_output=True, text=True
    ).stderr
    assert json.loads(json_line)["event"] == "hello"  # not a terminal: JSON
    console = subprocess.run(
        [sys.executable, "-c", code, "console"], check=False, capture_output=True, text=True
    ).stderr
    assert "hello" in console and "n=1" in console and not console.lstrip().startswith("{")


@pytest.mark.slow
def test_logs_follow_stderr_when_it_is_swapped_and_the_old_one_closed():
    """A host that swaps stderr (pytest's capture does, test by test) and closes the old one:
    a logger cached on first use writes to the new stderr instead of failing on a closed file."""
    code = (
        "import io, sys; from services.common.logging import configure_logging, get_logger; "
        "configure_logging('t', 'info', 'json'); log = get_logger(); "
        "first = sys.stderr = io.StringIO(); log.info('one'); first.close(); "
        "second = sys.stderr = io.StringIO(); log.info('two'); sys.__stderr__.write(second.getvalue())"
    )
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stderr)["event"] == "two"


def canned_status(state: str = "not_serving") -> dict:
    worker = {
        "name": "expert-1", "address": "10.0.0.2:50061", "host": "10.0.0.2", "up": False,
        "last_error": "unreachable (UNAVAILABLE): connection refused", "layers": "0-47", "experts": "64-127",
        "min_replicas": 0, "memory_budget_bytes": 8e9, "resident_bytes": 4e9, "cache_hits": 9,
        "cache_misses": 1, "cache_hit_rate": 0.9, "bytes_read": 1e9, "read_gbps": 2.5,
        "calls": 10, "errors": 1, "retries": 0,
    }  # fmt: skip
    prefix = {
        "lookups": 4,
        "hits": 1,
        "hit_rate": 0.25,
        "hit_tokens": 9,
        "entries": 1,
        "bytes": 10,
        "budget_bytes": 100,
    }
    core = {
        "state": state, "address": "10.0.0.1:50051", "problems": ["layers 0-47 experts 64-127 have no reachable worker"],
        "running": 0, "waiting": 0, "kv_cache_bytes": 0, "kv_cache_capacity_bytes": 100,
        "prompt_tokens_total": 1, "generation_tokens_total": 2, "prefix_cache": prefix,
    }  # fmt: skip
    return {
        "model": "m", "version": "1", "time": 0, "gateway": {"address": "0.0.0.0:8000", "up": True},
        "core": core, "workers": [worker], "layers": [{"layer": 0, "calls": 5, "p50_us": 812.0, "p99_us": 1600.0}],
        "throughput": [],
    }  # fmt: skip


def test_status_table_shows_what_is_down_and_why():
    text = render(canned_status())
    assert "core not serving" in text
    assert "problem: layers 0-47 experts 64-127 have no reachable worker" in text
    row = next(line for line in text.splitlines() if line.startswith("expert-1"))
    for cell in ("DOWN", "0-47", "64-127", "90%", "8.0 GB", "unreachable (UNAVAILABLE)"):
        assert cell in row, row
    assert any(line.split()[:4] == ["0", "5", "812", "1600"] for line in text.splitlines())


def test_status_page_and_data_need_a_key_and_take_it_as_a_browser_sends_it():
    app = create_app("unix:/nonexistent.sock", api_keys=("s3cret",), unary_timeout_s=0.5)
    with TestClient(app) as client:
        page = client.get("/status")
        assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
        assert client.get("/status.json").status_code == 401
        basic = {"Authorization": "Basic " + base64.b64encode(b"any:s3cret").decode()}
        wrong = {"Authorization": "Basic " + base64.b64encode(b"any:nope").decode()}
        assert client.get("/status.json", headers=wrong).status_code == 401
        page = client.get("/status", headers=basic)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert client.get("/static/status.js").status_code == 401  # the page's assets: behind the keys
        assert client.get("/static/status.js", headers=basic).status_code == 200
        data = client.get("/status.json", headers={"Authorization": "Bearer s3cret"})
        assert data.status_code == 200 and data.json()["core"]["state"] == "unreachable"
        # Basic is for the page only: the API keeps to bearer and x-api-key
        assert client.post("/v1/chat/completions", headers=basic, json={}).status_code == 401


def test_quiet_reaches_core_from_up():
    from services.ops.cli import _serving_cli_args, build_parser

    up = build_parser().parse_args(["up", "--quiet", "--max-num-seqs", "4"])
    passed = _serving_cli_args(up)
    assert "--quiet" in passed and passed[passed.index("--max-num-seqs") + 1] == "4"
    assert "--quiet" not in _serving_cli_args(build_parser().parse_args(["up"]))
    assert build_parser().parse_args(["core", *passed]).quiet
