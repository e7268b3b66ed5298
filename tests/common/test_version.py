"""moe-mesh says its version: `moe-mesh --version` on the command line, `GET /version` over HTTP
(vLLM's shape), both the installed distribution's."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from tests.helpers import REPO


def test_cli_prints_the_installed_version():
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    assert out.stdout.strip() == f"moe-mesh {metadata.version('moe-mesh')}"
