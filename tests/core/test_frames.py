"""The same-host frame path between core and workers (services/common/frames.py): real
worker processes on Unix sockets, core's ExpertDispatcher, and raw frames from a test client."""

from __future__ import annotations

import socket
import time

import grpc
import mlx.core as mx
import numpy as np
import pytest

from services.common.frames import HEADER, frame
from services.core.expert_link.dispatcher import ExpertCallError, ExpertDispatcher
from services.core.expert_link.links import HOP_PARTS
from services.proto.moemesh.v1 import expert_pb2
from tests.helpers import linked_dispatcher

pytestmark = pytest.mark.slow  # starts processes or computes for seconds


def _inputs(manifest, tokens=3, seed=0):
    k = manifest.experts_per_token
    rng = np.random.default_rng(seed)
    hidden = mx.array(rng.standard_normal((tokens, manifest.hidden_size)).astype(np.float32))
    ids = mx.array(
        np.stack([rng.choice(manifest.num_experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    )
    mx.eval(hidden, ids)
    return hidden, ids


def assert_fails_naming_worker(workers, index: int, dispatcher, make_call) -> None:
    """make_call() fails with UNAVAILABLE naming worker `index`, within the call deadline."""
    started = time.monotonic()
    with pytest.raises(ExpertCallError) as error:
        make_call()
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert workers.addresses[index].removeprefix("unix:") in str(error.value)
    assert time.monotonic() - started < dispatcher.call_timeout_s


@pytest.fixture(scope="module")
def split(tiny_models):
    return tiny_models.split("qwen3_moe", None)


@pytest.mark.parametrize("spin_us", [0, 5000])
def test_calls_take_the_frame_path_and_equal_the_grpc_path(split, tmp_path, spin_us):
    spin = {"worker_args": ("--frame-spin-us", str(spin_us)), "frame_spin_s": spin_us / 1e6}
    with linked_dispatcher(split, tmp_path, ["0-3", "4-7"], **spin) as (workers, frames, manifest):
        assert all(link.frames is not None and link.frames.spin_s == spin_us / 1e6 for link in frames.links)
        grpc_only = ExpertDispatcher(manifest, workers.addresses, frames=False)
        try:
            assert grpc_only.discover() == []
            layer = manifest.layer_indices[0]
            for seed in range(3):  # split over both workers: two frames per call
                hidden, ids = _inputs(manifest, seed=seed)
                got = frames.call(layer, hidden, ids)
                assert frames.links[0].frames._socket is not None  # it went over the frame socket
                assert mx.allclose(got, grpc_only.call(layer, hidden, ids), atol=0, rtol=0).item()
        finally:
            grpc_only.close()


def test_a_bad_call_is_invalid_argument_and_the_next_one_works(split, tmp_path):
    with linked_dispatcher(split, tmp_path, ["0-7"]) as (_, dispatcher, manifest):
        layer = manifest.layer_indices[0]
        hidden, ids = _inputs(manifest)
        bad = mx.array(np.full(ids.shape, manifest.num_experts + 5, dtype=np.int32))
        with pytest.raises(ExpertCallError) as error:
            dispatcher.call(layer, hidden, bad)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert dispatcher.call(layer, hidden, ids).shape == (*ids.shape, manifest.hidden_size)


def test_garbage_on_the_frame_socket_closes_that_connection_only(split, tmp_path):
    with linked_dispatcher(split, tmp_path, ["0-7"]) as (_, dispatcher, manifest):
        path = dispatcher.links[0].describe.frames_path
        for junk in (HEADER.pack(1 << 31), frame(b"\xff\xfe not a protobuf")):
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(10)
                sock.connect(path)
                sock.sendall(junk)
                assert sock.recv(1) == b""  # closed by the worker
        hidden, ids = _inputs(manifest)
        assert dispatcher.call(manifest.layer_indices[0], hidden, ids).shape[0] == 3
        assert dispatcher.links[0].frames._socket is not None  # still over frames


def test_a_killed_worker_fails_the_call_naming_it_then_a_restart_serves_again(split, tmp_path):
    with linked_dispatcher(split, tmp_path, ["0-7"]) as (workers, dispatcher, manifest):
        layer = manifest.layer_indices[0]
        hidden, ids = _inputs(manifest)
        dispatcher.call(layer, hidden, ids)
        workers.kill(0)
        assert_fails_naming_worker(workers, 0, dispatcher, lambda: dispatcher.call(layer, hidden, ids))
        workers.start(0)
        deadline = time.monotonic() + 30
        while True:  # core reconnects in the background
            try:
                assert dispatcher.call(layer, hidden, ids).shape[0] == 3
                break
            except ExpertCallError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def test_a_frame_socket_core_cannot_reach_is_left_to_grpc(tmp_path):
    from services.common.frames import FrameError
    from services.core.expert_link.frame_link import MAX_FAILED_CONNECTS, FrameLink

    link = FrameLink(str(tmp_path / "missing.sock.frames"), 1 << 20)
    for _ in range(MAX_FAILED_CONNECTS):
        assert link.usable
        with pytest.raises(FrameError) as error:
            link.send(expert_pb2.ExpertCall(call_id=1), time.monotonic() + 5)
        assert not error.value.timed_out
    assert not link.usable


def _connect(path: str) -> socket.socket:
    for _ in range(200):  # a full listen backlog answers EAGAIN until the worker accepts
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            time.sleep(0.01)
    raise AssertionError("the worker never accepted")


def test_connections_past_the_cap_are_closed_and_calls_still_work(split, tmp_path):
    from services.experts import frame_server

    with linked_dispatcher(split, tmp_path, ["0-7"]) as (_, dispatcher, manifest):
        path = dispatcher.links[0].describe.frames_path
        hidden, ids = _inputs(manifest)
        dispatcher.call(manifest.layer_indices[0], hidden, ids)  # core's own connection: 1 open
        extra = []
        try:
            for _ in range(frame_server.MAX_CONNECTIONS - 1):  # fill the worker's cap
                extra.append(_connect(path))
            with _connect(path) as over:  # the kernel accepts; the worker closes it at once
                over.settimeout(10)
                assert over.recv(1) == b""
            assert dispatcher.call(manifest.layer_indices[0], hidden, ids).shape[0] == 3
        finally:
            for sock in extra:
                sock.close()


def test_a_call_is_timed_part_by_part(split, short_tmp):
    """Core's timers split a layer call into its parts (what bench/hop_profile.py reports): on a
    frame link, where core and worker share a clock, send and reply too; the parts fit inside the
    call, and a reset empties them."""
    with linked_dispatcher(split, short_tmp, ["all"]) as (_, dispatcher, manifest):
        layer = manifest.layer_indices[0]
        for seed in range(5):
            dispatcher.call(layer, *_inputs(manifest, seed=seed))
        calls, parts = dispatcher.timings.snapshot_all(reset=True)
        names = HOP_PARTS[1:]  # the call's own parts (core_sync is the proxy's, before the call)
        assert set(names) <= set(parts) and all(len(parts[name]) == 5 for name in names)
        assert all((parts[name] >= 0).all() for name in names)
        assert (sum(parts[name] for name in names) <= calls[:, 0] * 1.01 + 50).all()  # within the call
        assert dispatcher.timings.snapshot_all()[1] == {}
