"""The gateway's memory is bounded: open connections beyond --max-connections get 503, request
bodies beyond the in-flight budget get 429 with Retry-After (never read), and what a body becomes
in the handler stays within the expansion `moe-mesh plan` counts. Real gateway, real sockets."""

from __future__ import annotations

import json
import socket
import tracemalloc

import httpx
import pytest

from services.gateway.generate_mapping import build_chat_request
from services.gateway.memory_bound import BODY_EXPANSION, MIB, RequestMemoryBudget, gateway_bound_bytes
from services.gateway.openai_schema import ChatCompletionRequest
from services.ops.plan import memory_plan

from .conftest import GatewayThread
from .test_http_limits import answer_of, connect

CHAT = {"model": "tiny-moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def small_gateway(core_server, core):
    gateway = GatewayThread(
        core_server.target, max_connections=6, model_name_hint="tiny-moe", request_memory_mb=1
    ).start()
    yield gateway
    gateway.stop()


def start_body(url: str, length: int, sent: bytes = b"{") -> socket.socket:
    """A chat request that announces `length` bytes and sends only the first of them."""
    sock = connect(url)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    sock.sendall(head.encode() + sent)
    return sock


def test_the_budget_is_all_or_nothing():
    budget = RequestMemoryBudget(100)
    assert budget.reserve(60) and not budget.reserve(41) and budget.reserve(40)
    budget.release(60)
    assert budget.in_flight == 40 and budget.reserve(60)


def test_bodies_beyond_the_budget_get_429_and_fit_again_once_released(small_gateway):
    url = small_gateway.url
    holding = start_body(url, 800 * 1024)  # holds 800 KiB of the 1 MiB budget while it trickles
    try:
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 300_000}]})
        refused = httpx.post(
            url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "gateway_busy"
        chunked = httpx.post(url + "/v1/chat/completions", content=iter([body.encode()]))  # no length
        assert chunked.status_code == 429 and chunked.json()["error"]["code"] == "gateway_busy"
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200  # small ones fit
    finally:
        holding.close()
    for _ in range(50):  # the server sees the close and releases the held bytes
        if small_gateway.server.config.app.state.request_memory.in_flight == 0:
            break
        httpx.get(url + "/version")
    assert (
        httpx.post(
            url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        ).status_code
        == 200
    )
    assert small_gateway.server.config.app.state.request_memory.in_flight == 0


def test_connections_beyond_the_cap_get_503_and_are_closed(small_gateway):
    url = small_gateway.url
    held = [connect(url) for _ in range(6)]
    try:
        extra = connect(url)
        assert answer_of(extra).startswith(b"HTTP/1.1 503")
        extra.close()
    finally:
        for sock in held:
            sock.close()
    assert httpx.get(url + "/version").status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "word " * 200_000}]},
        {
            "messages": [
                {"role": "user" if i % 2 else "assistant", "content": "hi there"} for i in range(20_000)
            ]
        },
        {"messages": [{"role": "user", "content": "é漢字🙂" * 100_000}]},
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                for i in range(5_000)
            ],
        },
    ],
    ids=["one_long_message", "many_short_messages", "unicode", "many_tools"],
)
def test_a_body_becomes_at_most_the_expansion_plan_counts(body):
    raw = json.dumps({"model": "m", **body}, ensure_ascii=False).encode()
    tracemalloc.start()
    try:
        request = ChatCompletionRequest.model_validate(json.loads(raw))
        build_chat_request(request, "id").SerializeToString()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= BODY_EXPANSION * len(raw)


async def test_an_image_body_becomes_at_most_the_expansion_plan_counts():
    """A data: URL image: the body, its parsed and validated text, the file decoded from base64, the
    gRPC message. (The pixels of the check are counted apart, in image_work_bytes.)"""
    import base64
    import io
    import os

    from PIL import Image

    from services.gateway.image_parts import ImageLoader, chat_image_sources

    png = io.BytesIO()
    Image.frombytes("RGB", (400, 400), os.urandom(400 * 400 * 3)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()
    tracemalloc.start()
    try:
        request = ChatCompletionRequest.model_validate(json.loads(raw))
        async with ImageLoader().load(chat_image_sources(request)) as images:
            build_chat_request(request, "id", images).SerializeToString()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= BODY_EXPANSION * len(raw)


def test_plan_states_the_gateways_bound(tiny_models):
    plan = memory_plan(tiny_models.split("qwen3_moe", None), 1.0, 1)
    assert plan["gateway_memory"]["bound_bytes"] == gateway_bound_bytes() > 64 * MIB


def test_up_hands_the_gateway_its_limits_at_the_bound_plan_states():
    from services.gateway.cli_flags import gateway_pass_args
    from services.gateway.memory_bound import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_MEMORY_MB
    from services.ops.cli import build_parser

    passed = gateway_pass_args(build_parser().parse_args(["up"]))
    assert passed[passed.index("--max-connections") + 1] == str(DEFAULT_MAX_CONNECTIONS)
    assert passed[passed.index("--max-request-memory-mb") + 1] == str(DEFAULT_REQUEST_MEMORY_MB)
    passed = gateway_pass_args(build_parser().parse_args(["up", "--max-request-memory-mb", "8"]))
    assert passed[passed.index("--max-request-memory-mb") + 1] == "8"
