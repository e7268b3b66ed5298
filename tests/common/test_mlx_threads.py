"""Threads that ran MLX end without aborting the process (services/common/mlx_threads.py).

Without `mx.clear_streams()` at a thread's end, a process whose threads ran compiled MLX graphs
aborts at exit now and then (four such threads: ~60 % of runs on this machine, "terminate called
without an active exception"); a core stopping on SIGTERM exited -6 that way in CI. Each case runs
in a fresh process five times: an unreleased thread would fail it almost surely."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import pytest

from services.common import mlx_threads
from tests.helpers import REPO

WORK = """
import threading
import mlx.core as mx
from services.common.mlx_threads import MlxThread, releasing_mlx

@mx.compile
def gate(x, y):
    return x * mx.sigmoid(x) * y

def work():
    for i in range(30):
        x = mx.random.normal((4, 64 + i % 7))
        mx.eval(gate(x, x))
"""

THREADS = (
    WORK
    + """
threads = [threading.Thread(target=releasing_mlx(work), daemon=True) for _ in range(4)]
for t in threads:
    t.start()
busy = sum(len(str(i)) for i in range(300_000))  # the main thread runs Python as they end
for t in threads:
    t.join()
"""
)

EXECUTORS = (
    WORK
    + """
executors = [MlxThread(f"mlx-{i}") for i in range(4)]
futures = [e.submit(work) for e in executors]
for f in futures:
    f.result()
for e in executors:
    e.close()
busy = sum(len(str(i)) for i in range(300_000))
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("script", [THREADS, EXECUTORS], ids=["releasing_mlx", "MlxThread"])
def test_threads_that_ran_compiled_mlx_let_the_process_exit_0(script):
    for _ in range(5):
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@pytest.fixture
def released(monkeypatch):
    """Names of the threads that released MLX (the real release still runs)."""
    names: list[str] = []
    real = mlx_threads.release_mlx

    def record() -> None:
        names.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(mlx_threads, "release_mlx", record)
    return names


def test_a_closed_mlx_thread_is_released_and_refuses_more_work(released):
    executor = mlx_threads.MlxThread("long-call")
    assert executor.submit(lambda: mx.eval(mx.ones(3) + 1)).result() is None
    executor.close()
    assert released == ["long-call_0"]
    with pytest.raises(RuntimeError):
        executor.submit(print)
    executor.close()  # twice: no error, no second release
    assert released == ["long-call_0"]


def test_the_engine_thread_releases_mlx_when_it_ends(released, tiny_models):
    from mlx_lm.utils import load_tokenizer

    from services.core.engine import Engine, EngineConfig

    def loader():
        mx.eval(mx.ones(3) + 1)  # MLX ran on the engine thread
        raise RuntimeError("no model here")

    tokenizer = load_tokenizer(tiny_models.checkpoint("qwen3_moe", None))
    engine = Engine(tokenizer, EngineConfig(), loader)
    engine.start()
    engine.loaded.wait(10)
    engine.stop()
    assert isinstance(engine.load_error, RuntimeError)
    assert released == ["engine"]


def test_frame_connection_threads_release_mlx_and_are_waited_for(released, short_tmp):
    from services.common.frames import HEADER, frame, frame_length, receive_exact
    from services.experts.frame_server import FrameServer
    from services.proto.moemesh.v1 import expert_pb2

    def answer(call):
        mx.eval(mx.ones(4) * 2)  # as the worker's compute does, on the connection's thread
        return expert_pb2.ExpertResult(call_id=call.call_id)

    server = FrameServer(str(short_tmp / "f.sock"), answer, 1 << 20)
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for client in clients:
            client.connect(str(short_tmp / "f.sock"))
            client.sendall(frame(expert_pb2.ExpertCall(call_id=7).SerializeToString()))
            size = frame_length(bytes(receive_exact(client, HEADER.size)), 1 << 20)
            assert expert_pb2.ExpertResult.FromString(bytes(receive_exact(client, size))).call_id == 7
        server.close()  # the connections are still open on the client side
        assert released == ["frames-conn", "frames-conn"]  # both ended (and released) before close returned
    finally:
        for client in clients:
            client.close()
