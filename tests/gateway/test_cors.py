"""CORS: a browser page on an allowed origin may call the API (its preflight is answered without a
key, and every answer, a 401 included, lets the page read it); other origins and a gateway started
without `--allowed-origins` get no CORS headers."""

from __future__ import annotations

import argparse

import httpx
import pytest

from services.gateway.cli_flags import origins

from .conftest import GatewayThread
from .core_double import MODEL_ID
from .test_gateway_openai_client import MESSAGES

UI = "http://ui.example:3000"
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip


@pytest.fixture
def gateway(core_server, request):
    served = GatewayThread(core_server.target, **request.param).start()
    yield served.url
    served.stop()


@pytest.mark.parametrize("gateway", [{"allowed_origins": (UI,), "api_keys": ("sk-k",)}], indirect=True)
def test_an_allowed_origin_gets_preflight_and_readable_answers(gateway):
    preflight = httpx.options(gateway + "/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == UI
    assert "POST" in preflight.headers["access-control-allow-methods"]
    body = {"model": MODEL_ID, "messages": MESSAGES}
    answered = httpx.post(
        gateway + "/v1/chat/completions", json=body, headers={"Origin": UI, "Authorization": "Bearer sk-k"}
    )
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == UI
    assert "x-request-id" in answered.headers["access-control-expose-headers"].lower()
    refused = httpx.post(gateway + "/v1/chat/completions", json=body, headers={"Origin": UI})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == UI
    other = httpx.options(
        gateway + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("gateway", [{}], indirect=True)
def test_without_allowed_origins_no_cors_headers_are_sent(gateway):
    preflight = httpx.options(gateway + "/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in preflight.headers
    answered = httpx.get(gateway + "/v1/models", headers={"Origin": UI})
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


def test_the_flag_takes_origins_or_a_star():
    assert origins("http://a.example, https://b.example:8443/") == (
        "http://a.example",
        "https://b.example:8443",
    )
    assert origins("*") == ("*",)
    for bad in ("a.example", "http://a.example/path"):
        with pytest.raises(argparse.ArgumentTypeError):
            origins(bad)
