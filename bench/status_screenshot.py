"""A screenshot of the status page (GET /status) for the docs, taken in headless Chromium.

    python bench/status_screenshot.py [--out docs/status-page.png]      # canned sample figures
    python bench/status_screenshot.py --url http://127.0.0.1:8000       # a running gateway
    python bench/status_screenshot.py --up [--seconds 60]               # `moe-mesh up` under load

Without --url or --up the page's own files are served with a sample /status.json shaped like a
two-worker demo cluster under load (`sample_status`). --up starts `moe-mesh up --experts 2` on the
demo model (--expert-memory-gb caps each worker's expert RAM, so its expert cache and SSD reads
have figures), runs the soak's mixed traffic for a while and shoots the page while it runs.
Needs the `playwright` package and Debian's /usr/bin/chromium (no browser download).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
STATIC = REPO / "services" / "gateway" / "static"
CHROMIUM = Path("/usr/bin/chromium")
FILES = {  # the paths the gateway serves them at
    "/status": ("status.html", "text/html; charset=utf-8"),
    "/static/status.css": ("status.css", "text/css; charset=utf-8"),
    "/static/status.js": ("status.js", "text/javascript; charset=utf-8"),
}


def sample_status(now: float | None = None, layers: int = 30, seed: int = 7) -> dict:
    """A made-up /status.json shaped like the demo model on two workers a few minutes into a load
    (one worker remote with an expert RAM budget, so every column has figures)."""
    from services.common.version import moe_mesh_version

    rng = random.Random(seed)
    now = time.time() if now is None else now
    mib = 1024 * 1024
    throughput = []
    for i in range(60):  # 5 minutes, one sample every 5 s
        t = now - 5 * (59 - i)
        load = 0.55 + 0.35 * math.sin(i / 7) + 0.1 * rng.random()
        throughput.append(
            {
                "t": t,
                "generation_tok_s": round(max(0.0, 140 * load + rng.gauss(0, 6)), 1),
                "prompt_tok_s": round(max(0.0, 900 * load * (0.4 + rng.random())), 1),
            }
        )
    per_layer = []
    for layer in range(layers):
        p50 = 420 + 60 * math.sin(layer / 4) + rng.uniform(0, 90)
        per_layer.append(
            {
                "layer": layer,
                "calls": 18200 + rng.randint(0, 40),
                "p50_us": round(p50, 1),
                "p99_us": round(p50 * rng.uniform(1.8, 3.2), 1),
            }
        )
    worker = {
        "host": "this host",
        "up": True,
        "last_error": "",
        "layers": f"0-{layers - 1}",
        "min_replicas": 1,
        "retries": 0,
    }
    return {
        "model": "smollm2-135m-moe8",
        "version": moe_mesh_version(),
        "time": now,
        "gateway": {"address": "127.0.0.1:8000", "up": True},
        "core": {
            "state": "serving",
            "address": "unix:/tmp/mm-up/core.sock",
            "problems": [],
            "running": 12,
            "waiting": 3,
            "kv_cache_bytes": 402 * mib,
            "kv_cache_capacity_bytes": 1024 * mib,
            "prompt_tokens_total": 1_843_211,
            "generation_tokens_total": 412_907,
            "prefix_cache": {
                "lookups": 2311,
                "hits": 1408,
                "hit_rate": 1408 / 2311,
                "hit_tokens": 611_302,
                "entries": 214,
                "bytes": 388 * mib,
                "budget_bytes": 1024 * mib,
            },
        },
        "workers": [
            {
                **worker,
                "name": "expert-0",
                "address": "unix:/tmp/mm-up/expert-0.sock",
                "experts": "0-3",
                "memory_budget_bytes": 0,
                "resident_bytes": 96 * mib,
                "cache_hits": 0,
                "cache_misses": 0,
                "cache_hit_rate": None,
                "bytes_read": 0,
                "read_gbps": 0.0,
                "calls": 546_120,
                "errors": 0,
            },
            {
                **worker,
                "name": "expert-1",
                "address": "10.0.0.12:7101",
                "host": "mac-studio-2",
                "experts": "4-7",
                "memory_budget_bytes": 64 * mib,
                "resident_bytes": 61 * mib,
                "cache_hits": 1_931_044,
                "cache_misses": 88_310,
                "cache_hit_rate": 1_931_044 / (1_931_044 + 88_310),
                "bytes_read": 14_200 * mib,
                "read_gbps": 2.41,
                "calls": 546_117,
                "errors": 2,
                "retries": 2,
            },
        ],
        "layers": per_layer,
        "throughput": throughput,
    }


class StaticStatusServer:
    """The page's files at the gateway's paths plus `status()` as /status.json, on 127.0.0.1:0.

    `status` returns a dict (served as JSON) or an int (that HTTP status, no body)."""

    def __init__(self, status: Callable[[], dict | int]):
        self.status = status
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                owner.requests.append(path)
                if path == "/status.json":
                    reply = owner.status()
                    if isinstance(reply, int):
                        self._send(reply, b"", "text/plain")
                    else:
                        self._send(200, json.dumps(reply).encode(), "application/json")
                elif path in FILES:
                    name, content_type = FILES[path]
                    self._send(200, (STATIC / name).read_bytes(), content_type)
                else:
                    self._send(404, b"not found", "text/plain")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet under pytest

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="status-page", daemon=True)

    def __enter__(self) -> StaticStatusServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def browser_page(width: int = 1440, height: int = 900, api_key: str | None = None) -> Iterator:
    """A fresh page in headless /usr/bin/chromium (light colour scheme, 1x pixels); `api_key`: the
    browser answers the gateway's login box with it, as a person would."""
    from playwright.sync_api import sync_playwright

    credentials = {"http_credentials": {"username": "operator", "password": api_key}} if api_key else {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(
                viewport={"width": width, "height": height}, color_scheme="light", **credentials
            )
            yield page
        finally:
            browser.close()


def shoot(url: str, out: Path, settle_s: float = 0.0) -> int:
    """Open `url`/status, wait for a first render (and `settle_s` more), write a full-page PNG."""
    with browser_page() as page:
        page.goto(f"{url}/status")
        page.wait_for_selector("#cluster-body tr")
        page.wait_for_timeout(settle_s * 1000)
        page.screenshot(path=str(out), full_page=True)
    return out.stat().st_size


def shoot_up(out: Path, seconds: float, expert_memory_gb: float) -> int:
    """`moe-mesh up --experts 2` on the demo model under the soak's traffic, shot mid-load; each
    worker's expert RAM capped at `expert_memory_gb` (0: all resident)."""
    import asyncio

    import httpx

    from bench.soak_traffic import run_clients
    from bench.workdir import bench_workdir
    from tests.e2e.test_up import start_up

    workdir = bench_workdir("mm-shot-")
    cache = Path(os.environ.get("MOE_MESH_CACHE") or workdir / "cache")
    flags = ["--experts", "2", "--served-model-name", "demo"]
    if expert_memory_gb:
        flags += ["--expert-memory-gb", str(expert_memory_gb)]
    proc, url = start_up(cache, workdir / "up", *flags)
    base = url.removesuffix("/v1")
    try:
        if httpx.get(f"{base}/status.json").status_code == 404:
            raise SystemExit("this gateway has no /status.json")
        load = threading.Thread(
            target=lambda: asyncio.run(run_clients(base, "demo", 8, seconds)), daemon=True
        )
        load.start()
        return shoot(base, out, settle_s=seconds * 0.8)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "status-page.png")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--url", help="a running gateway's base URL, e.g. http://127.0.0.1:8000")
    source.add_argument("--up", action="store_true", help="start `moe-mesh up --experts 2` under load")
    parser.add_argument("--seconds", type=float, default=60, help="--up: seconds of load before the shot")
    parser.add_argument(
        "--expert-memory-gb", type=float, default=0, help="--up: cap each worker's expert RAM (GB)"
    )
    args = parser.parse_args()
    if args.url:
        size = shoot(args.url.rstrip("/"), args.out, settle_s=1)
    elif args.up:
        size = shoot_up(args.out, args.seconds, args.expert_memory_gb)
    else:
        sample = sample_status()
        with StaticStatusServer(lambda: sample) as server:
            size = shoot(server.url, args.out)
    print(f"{args.out}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
