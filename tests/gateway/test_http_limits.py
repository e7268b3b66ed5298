"""Clients that hold connections without sending requests are bounded: idle connections, headers
dripped or oversized, bodies that stall or trickle; the gateway serves others meanwhile. The real
gateway app under the real uvicorn settings (services/gateway/server.py), with short limits."""

from __future__ import annotations

import resource
import socket
import time

import httpx
import pytest

from services.gateway import http_limits
from services.gateway.memory_bound import MAX_HEADER_BYTES
from services.gateway.server import raise_open_file_limit

from .conftest import GatewayThread

LIMIT_S = 1.0


@pytest.fixture
def limited_gateway(core_server, core, monkeypatch):
    for name in ("HEADER_TIMEOUT_S", "BODY_IDLE_TIMEOUT_S", "BODY_GRACE_S"):
        monkeypatch.setattr(http_limits, name, LIMIT_S)
    gateway = GatewayThread(core_server.target, model_name_hint="tiny-moe").start()
    yield gateway
    gateway.stop()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(LIMIT_S * 10)
    return sock


def answer_of(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def served(url: str) -> bool:
    return httpx.get(url + "/version", timeout=5).status_code == 200


def test_headers_dripped_slowly_get_408_and_others_are_served(limited_gateway):
    sock = connect(limited_gateway.url)
    with sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for _ in range(3):
            sock.sendall(b"X-Drip: 1\r\n")
            assert served(limited_gateway.url)
            time.sleep(LIMIT_S / 3)
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < LIMIT_S * 5


def test_a_thousand_idle_connections_are_closed_and_never_block_a_request(limited_gateway):
    raise_open_file_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = min(1000, (soft - 200) // 2)  # both ends live in this process
    assert count >= 400, f"open file limit {soft} is too low for this test"
    idle = [connect(limited_gateway.url) for _ in range(count)]
    try:
        started = time.monotonic()
        assert served(limited_gateway.url)
        assert time.monotonic() - started < 2
        closed = sum(1 for sock in idle if answer_of(sock).startswith(b"HTTP/1.1 408"))
        assert closed == count
    finally:
        for sock in idle:
            sock.close()
    assert served(limited_gateway.url)


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 100, 100_000, 1 << 20])
def test_oversized_headers_get_431(limited_gateway, size):
    reply = httpx.get(limited_gateway.url + "/version", headers={"X-Big": "a" * size}, timeout=10)
    assert reply.status_code == 431
    assert served(limited_gateway.url)


def test_headers_just_under_the_limit_with_a_body_in_the_same_send_are_served(limited_gateway):
    """A request whose headers fit is served even when its body, sent along, takes it past the cap."""
    sock = connect(limited_gateway.url)
    with sock:
        body = b'{"text": "' + b"a" * (2 * MAX_HEADER_BYTES) + b'"}'
        head = (
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        )
        head += b"X-Fill: " + b"b" * (MAX_HEADER_BYTES - len(head) - 200) + b"\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        assert len(head) < MAX_HEADER_BYTES
        sock.sendall(head + body)
        answer = answer_of(sock)
    assert not answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]


@pytest.mark.parametrize("trickle", [False, True])
def test_a_body_that_stalls_or_trickles_gets_408(limited_gateway, trickle):
    sock = connect(limited_gateway.url)
    with sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        started = time.monotonic()
        while trickle and time.monotonic() - started < LIMIT_S * 4:
            try:
                sock.sendall(b" ")  # one byte at a time: progress, far below the minimum rate
            except OSError:
                break  # refused and closed
            time.sleep(0.1)
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < LIMIT_S * 6
    assert served(limited_gateway.url)
