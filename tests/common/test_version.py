"""moe-mesh says its version: `moe-mesh --version` on the command line (`GET /version`, vLLM's
shape, in tests/gateway/test_gateway_http.py), the installed distribution's."""

from __future__ import annotations

from importlib import metadata

from tests.helpers import run_cli


def test_cli_prints_the_installed_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"moe-mesh {metadata.version('moe-mesh')}"
