"""bench/delay_relay.py, which the slow-link soak puts between core and a worker: it passes bytes
through, and SIGUSR1 / SIGUSR2 switch a live connection's delay on and off."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.ops.up import free_port

pytestmark = pytest.mark.slow

RELAY = Path(__file__).resolve().parents[2] / "bench" / "delay_relay.py"


def echo_server() -> int:
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def round_trip_s(conn: socket.socket, payload: bytes) -> float:
    started = time.monotonic()
    conn.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += conn.recv(4096)
    assert got == payload
    return time.monotonic() - started


def test_the_delay_switches_on_a_live_connection():
    target, listen = echo_server(), free_port()
    args = ["--listen", f"127.0.0.1:{listen}", "--target", f"127.0.0.1:{target}"]
    relay = subprocess.Popen(
        [sys.executable, str(RELAY), *args, "--delay-ms", "60", "--initial-delay-ms", "0"]
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", listen), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the relay did not listen"
                time.sleep(0.05)
        with conn:
            assert round_trip_s(conn, b"fast") < 0.1
            relay.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            assert round_trip_s(conn, b"slow") >= 0.12  # 60 ms each way
            relay.send_signal(signal.SIGUSR2)
            time.sleep(0.2)
            assert round_trip_s(conn, b"fast again") < 0.1
    finally:
        relay.terminate()
        relay.wait(timeout=10)
