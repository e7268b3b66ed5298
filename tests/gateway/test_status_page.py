"""The status page (GET /status) in a real headless Chromium.

One test serves the page's files with canned /status.json answers; the other opens the page on a
real `moe-mesh up --experts 2` and stops a worker. Chromium is Debian's /usr/bin/chromium driven
by the `playwright` package (no browser download); both are skipped when either is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.status_screenshot import CHROMIUM, STATIC, StaticStatusServer, browser_page, sample_status

API_KEY = "status-page-key"
needs_browser = pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None or not CHROMIUM.exists(),
    reason="needs the playwright package and /usr/bin/chromium (apt-get install chromium)",
)


class Console:
    """Everything the page logs at warning level or above, and its uncaught exceptions."""

    def __init__(self, page) -> None:
        self.messages: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.messages.append(f"pageerror: {error}"))

    def _console(self, message) -> None:
        if message.type in ("error", "warning", "assert"):
            self.messages.append(f"{message.type}: {message.text}")

    def take(self) -> list[str]:
        taken, self.messages = self.messages, []
        return taken


def one_worker_down() -> dict:
    """The sample cluster with expert-1 down and never answered: empty strings and zeros."""
    status = sample_status()
    status["core"]["state"] = "not_serving"
    problem = "layers 0-29 experts 4-7 have no reachable worker (last served by expert-1 at 10.0.0.12:7101)"
    status["core"]["problems"] = [problem]
    down = status["workers"][1]
    for key, value in down.items():
        if isinstance(value, bool):
            down[key] = False
        elif isinstance(value, int | float) and key != "min_replicas":
            down[key] = 0
    down.update(cache_hit_rate=None, host="", last_error="connect: connection refused")
    return status


def unreachable_core() -> dict:
    status = sample_status()
    status["core"] = {"state": "unreachable", "address": status["core"]["address"], "problems": []}
    status.update(workers=[], layers=[], throughput=[])
    return status


def row_text(page, table: str, name: str) -> str:
    return page.locator(f'#{table}-body tr[data-name="{name}"]').inner_text()


def test_page_files_are_self_contained():
    """Offline: nothing is fetched from another origin, and the HTML names the gateway's paths."""
    html = (STATIC / "status.html").read_text()
    assert 'href="/static/status.css"' in html and 'src="/static/status.js"' in html
    assert '<link rel="icon" href="data:,">' in html
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|@import|url\(", text), path.name
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text, path.name
        urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (path.name, urls)


@pytest.mark.slow  # drives a browser process
@needs_browser
def test_page_renders_canned_status():
    replies: list = [one_worker_down()]
    with StaticStatusServer(lambda: replies[-1]) as server, browser_page() as page:
        console = Console(page)
        page.goto(f"{server.url}/status")
        page.wait_for_selector('#cluster-body tr[data-name="expert-1"]')
        # both workers, the one down said so in words
        assert page.locator("#cluster-body tr").count() == 4  # core, gateway, two workers
        assert "up" in row_text(page, "cluster", "expert-0").split()
        assert "down" in row_text(page, "cluster", "expert-1").split()
        assert "connection refused" in row_text(page, "cluster", "expert-1")
        assert page.locator('#workers-body tr[data-status="down"]').count() == 1
        assert "down" in row_text(page, "workers", "expert-1").split()
        assert "no accesses" in row_text(page, "workers", "expert-1")
        # header: core not serving, its problem listed
        assert page.locator("#core-state-text").inner_text() == "core not serving"
        assert "no reachable worker" in page.locator("#problems").inner_text()
        assert page.locator("#model").inner_text() == "smollm2-135m-moe8"
        # a bar pair per layer, the throughput chart with both series
        layers = len(replies[-1]["layers"])
        assert page.locator(".layer-row").count() == layers
        assert page.locator(".layer-row .bar.p50").count() == layers
        assert page.locator("#layers-empty").is_hidden()
        assert page.locator("#throughput svg path.line").count() == 2
        assert "402 MiB of 1.00 GiB (39%)" in page.locator("#kv-text").inner_text()
        # polled again (2 s) without a complaint
        first = server.requests.count("/status.json")
        page.wait_for_function(
            "() => document.getElementById('updated').textContent !== 'never'", timeout=5000
        )
        deadline = time.monotonic() + 6
        while server.requests.count("/status.json") <= first and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        assert server.requests.count("/status.json") > first
        assert console.take() == []
        assert "/favicon.ico" not in server.requests

        # /status.json fails: a banner, the last data kept
        replies.append(503)
        page.wait_for_selector("#banner:not([hidden])", timeout=6000)
        assert "HTTP 503" in page.locator("#banner").inner_text()
        assert page.locator('#cluster-body tr[data-name="expert-0"]').count() == 1
        assert all("503" in message for message in console.take())  # Chromium logs the failed load

        # core unreachable: empty lists and zeros render as empty states
        replies.append(unreachable_core())
        page.wait_for_selector("#banner[hidden]", state="attached", timeout=6000)
        page.wait_for_selector('#core-state[data-state="unreachable"]', timeout=6000)
        assert page.locator("#layers-empty").inner_text() == "no remote layer calls yet"
        assert page.locator("#throughput-empty").is_visible()
        assert page.locator("#workers-empty").is_visible()
        assert "down" in row_text(page, "cluster", "core").split()
        assert console.take() == []


# ---- on a real cluster ----


@pytest.fixture
def up_cluster():
    """`moe-mesh up --experts 2` on the demo model: (its process, the gateway's base URL)."""
    from tests.e2e.test_up import launch_up, wait_serving
    from tests.helpers import short_dir

    cache = Path(os.environ.get("MOE_MESH_CACHE") or short_dir("mm-cache-"))
    proc, url = launch_up(cache, short_dir("mm-status-"), "--experts", "2", "--api-key", API_KEY)
    try:
        wait_serving(proc)
        yield proc, url.removesuffix("/v1")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@needs_browser
def test_page_shows_a_stopped_worker_down(up_cluster):
    """Behind API keys, as the API: the browser gives the key to the page's login box."""
    import httpx

    from bench.soak import up_processes

    proc, base = up_cluster
    assert httpx.get(f"{base}/status.json", timeout=10).status_code == 401
    refused = httpx.get(f"{base}/status", timeout=10)  # a browser without the key gets a login box
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
    workers = sorted(name for name in up_processes(proc.pid) if name.startswith("expert"))
    assert len(workers) == 2, workers
    with browser_page(api_key=API_KEY) as page:
        console = Console(page)
        page.goto(f"{base}/status")
        for name in workers:
            page.wait_for_selector(f'#cluster-body tr[data-name="{name}"][data-status="up"]', timeout=60_000)
        assert page.locator(".layer-row").count() > 0 or page.locator("#layers-empty").is_visible()
        stopped = workers[-1]
        pid = up_processes(proc.pid)[stopped]
        os.kill(pid, signal.SIGSTOP)  # stopped, not killed: `up` starts dead workers again
        try:
            row = f'#cluster-body tr[data-name="{stopped}"][data-status="down"]'
            page.wait_for_selector(row, timeout=30_000)
            assert "down" in row_text(page, "cluster", stopped).split()
            # core's own probe (every 2 s) finds the gap apart from this poll of the workers
            page.wait_for_selector('#core-state:not([data-state="serving"])', timeout=30_000)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert page.locator("#banner").is_hidden()  # every poll carried the key
        assert console.take() == []
