"""`moe-mesh up --distributed ring` as a user runs it: the demo model's layer calls ride an MLX group,
the official openai client gets its answer, and a worker that dies leaves the stack serving."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.test_up import QUESTION, service_pids, start_up
from tests.helpers import short_dir

pytestmark = pytest.mark.slow  # starts processes or computes for seconds


@pytest.fixture(scope="module")
def up_plane(tmp_path_factory):
    workdir = short_dir("mm-upd-")
    proc, url = start_up(tmp_path_factory.mktemp("cache"), workdir, "--experts", "1", "--distributed", "ring")
    yield proc, url, workdir
    if proc.poll() is None:
        proc.kill()


def ask(url: str) -> str:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2-135m-moe8", messages=QUESTION, temperature=0, max_tokens=16
    )
    return reply.choices[0].message.content


def test_the_answer_comes_over_the_group(up_plane):
    _, url, workdir = up_plane
    assert "Paris" in ask(url)
    assert "data_plane_formed" in (Path(workdir) / "core.log").read_text()
    worker_log = (Path(workdir) / "expert-0.log").read_text()
    assert "data_plane_joined" in worker_log and "data_plane_unavailable" not in worker_log


def test_a_worker_lost_from_the_group_is_started_again_and_serves_over_grpc(up_plane):
    proc, url, workdir = up_plane
    workers = service_pids(proc.pid, "expert")
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # 503 while core sees the worker missing, then served again over gRPC
        try:
            answer = ask(url)
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
    assert "Paris" in answer
    assert proc.poll() is None
    assert "data_plane_lost" in (Path(workdir) / "core.log").read_text()
