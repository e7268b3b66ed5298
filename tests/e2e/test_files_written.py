"""`moe-mesh up` writes only into its cache (MOE_MESH_CACHE) and its workdir: a home folder made
read-only and empty is still empty after the demo model is built, served and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from tests.e2e.test_up import QUESTION, wait_serving
from tests.helpers import free_port, short_dir

pytestmark = pytest.mark.slow


def test_up_writes_nothing_outside_its_cache_and_workdir(tmp_path):
    home, cache, workdir = tmp_path / "home", tmp_path / "cache", short_dir("mm-home-")
    home.mkdir()
    home.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME", "TMPDIR")}
    env |= {"HOME": str(home), "MOE_MESH_CACHE": str(cache)}
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.ops.cli",
            "up",
            "--port",
            str(port),
            "--experts",
            "2",
            "--workdir",
            str(workdir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_serving(proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8)
        assert reply.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "home"]
    assert list(home.rglob("*")) == [], "written into the home folder"
    assert list(cache.iterdir())  # the demo model was built where it should be
