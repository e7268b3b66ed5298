"""Separate hosts on one machine: Linux network namespaces joined by veth pairs.

`NetnsLab(workers=N)` makes one namespace for core and one per worker; worker i and
core share a point-to-point link (core 10.77.i.1, worker 10.77.i.2), so every byte
between them crosses a real network stack with its own addresses, as between Macs.
Processes run inside with `ip netns exec`; Unix sockets are not namespaced, so the
test reaches core's Unix socket from the root namespace. Names are prefixed
`mm-<pid>-` and everything is deleted on exit, also after a failure (and at
interpreter exit if the test process dies in between).

Needs root and the `ip` tool; `netns_unavailable()` says why not when it cannot run.
`tc netem` link delay needs the sch_netem kernel module, often missing in containers:
`add_delay` says whether it worked.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    """None when namespaces work here, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the cluster tests as root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    name = f"mm-{os.getpid()}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class NetnsLab:
    def __init__(self, workers: int, subnet: int = 77):
        self.prefix = f"mm-{os.getpid()}-{id(self) % 10000}"
        self.core_ns = f"{self.prefix}-core"
        self.worker_ns = [f"{self.prefix}-w{i}" for i in range(workers)]
        self.subnet = subnet
        self._tag = f"m{os.getpid() % 100000}{id(self) % 100}"  # veth names: at most 15 bytes
        self.procs: list[subprocess.Popen] = []
        self._closed = False

    def core_ip(self, i: int) -> str:
        return f"10.{self.subnet}.{i}.1"

    def worker_ip(self, i: int) -> str:
        return f"10.{self.subnet}.{i}.2"

    def __enter__(self) -> NetnsLab:
        atexit.register(self.close)
        try:
            _ip("netns", "add", self.core_ns)
            _ip("-n", self.core_ns, "link", "set", "lo", "up")
            for i, ns in enumerate(self.worker_ns):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                core_end, worker_end = f"{self._tag}c{i}", f"{self._tag}w{i}"
                _ip(
                    "link",
                    "add",
                    core_end,
                    "netns",
                    self.core_ns,
                    "type",
                    "veth",
                    "peer",
                    worker_end,
                    "netns",
                    ns,
                )
                _ip("-n", self.core_ns, "addr", "add", f"{self.core_ip(i)}/24", "dev", core_end)
                _ip("-n", ns, "addr", "add", f"{self.worker_ip(i)}/24", "dev", worker_end)
                _ip("-n", self.core_ns, "link", "set", core_end, "up")
                _ip("-n", ns, "link", "set", worker_end, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def spawn(self, ns: str, args: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
        """`python -m services.ops.cli ARGS` inside namespace `ns` (ip netns exec execs, so the pid is python's)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "services.ops.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=full_env,
            )
        self.procs.append(proc)
        return proc

    def in_ns(self, ns: str, fn):
        """Run fn() on a thread that has joined namespace `ns` (setns is per thread), return its result."""
        box: dict = {}

        def target():
            try:
                libc = ctypes.CDLL("libc.so.6", use_errno=True)
                with open(f"/var/run/netns/{ns}") as handle:
                    if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns {ns}")
                box["value"] = fn()
            except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = error

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def wait_port(self, ns: str, host: str, port: int, proc: subprocess.Popen, log: Path, timeout_s=60.0):
        import socket

        def probe() -> bool:
            try:
                socket.create_connection((host, port), timeout=0.5).close()
                return True
            except OSError:
                return False

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if self.in_ns(ns, probe):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{host}:{port} in {ns} not listening: {log.read_text()[-2000:]}")

    def http_get(self, ns: str, url: str) -> str:
        import urllib.request

        def get() -> str:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return reply.read().decode()

        return self.in_ns(ns, get)

    def add_delay(self, ms: float) -> bool:
        """Add `ms` of delay each way on every core<->worker link with tc netem; False if unavailable."""
        for i, ns in enumerate(self.worker_ns):
            for where, dev in ((self.core_ns, f"{self._tag}c{i}"), (ns, f"{self._tag}w{i}")):
                done = subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        where,
                        "tc",
                        "qdisc",
                        "replace",
                        "dev",
                        dev,
                        "root",
                        "netem",
                        "delay",
                        f"{ms}ms",
                    ],
                    check=False,
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0:
                    return False
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in [self.core_ns, *self.worker_ns]:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # anything a test started in there by other means
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)  # deletes the veth ends inside it too
