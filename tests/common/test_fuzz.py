"""Every decoder peers and users reach, fuzzed: 10,000 inputs each (bench/fuzz.py runs 1,000,000),
structured ExpertCalls from hypothesis, claimed sizes that must not allocate, and a live worker
that keeps answering good calls between bad ones."""

from __future__ import annotations

import random
import socket
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import fuzz, targets_for_split
from bench.fuzz_mutate import mutate_bytes
from bench.fuzz_targets import (
    CALL_CAP,
    Target,
    expert_call_seeds,
    guarded,
    tensor_target,
)
from services.common import tensor_codec
from services.common.frames import FIRST_ALLOCATION, HEADER, FrameError, frame, frames_path_for
from services.common.manifest import Manifest
from services.experts.frame_server import read_call
from services.proto.moemesh.v1 import expert_pb2, tensor_pb2
from tests.helpers import Workers

INPUTS = 10_000


@pytest.fixture(scope="module")
def split(tiny_models):
    return tiny_models.split("qwen3_moe", None)


@pytest.fixture(scope="module")
def targets(split) -> dict[str, Target]:
    return {target.name: target for target in targets_for_split(split)}


NAMES = [
    "expert_call",
    "frame_stream",
    "tensor",
    "manifest",
    "cluster_toml",
    "cluster_tables",
    "safetensors_header",
    "openai_chat",
    "openai_completions",
    "anthropic_messages",
]


@pytest.mark.parametrize("name", NAMES)
def test_ten_thousand_inputs_find_nothing(targets, name):
    result = fuzz(targets[name], INPUTS, seconds=None, seed=1)
    assert result["findings"] == 0, result["examples"][:3]
    assert result["inputs"] == INPUTS
    # the mutations reach both sides of the decoder, or the run proves little
    assert result["accepted"] > INPUTS // 100 and result["refused"] > INPUTS // 100, result


def test_the_fuzzer_finds_a_decoder_that_raises_the_wrong_error():
    """The bug it found first, put back: naming an unknown wire dtype raised ValueError."""

    def naive(data: bytes) -> str:
        tensor = tensor_pb2.Tensor.FromString(data)
        tensor_pb2.DType.Name(tensor.dtype)  # no name for 127: ValueError, which is not a refusal
        tensor_codec.decode(tensor, "hidden", CALL_CAP, ndim=2)
        return "accepted"

    from google.protobuf.message import DecodeError

    seeds = tensor_target().seeds
    broken = Target("naive", seeds, guarded(naive, (DecodeError, tensor_codec.TensorDecodeError)))
    assert fuzz(broken, INPUTS, seconds=None, seed=1)["findings"] > 0


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layer=st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1)),
    dtype=st.integers(-2, 200),
    shape=st.lists(st.one_of(st.integers(-2, 70), st.integers(-(2**63), 2**63 - 1)), max_size=3),
    data=st.binary(max_size=600),
    ids_dtype=st.sampled_from([0, 1, 4, 5, 99]),
    ids_shape=st.lists(st.integers(-1, 9), max_size=3),
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12),
)
@pytest.mark.slow  # thousands of inputs, seconds
def test_structured_calls_are_answered_or_refused_in_band(
    targets, layer, dtype, shape, data, ids_dtype, ids_shape, ids
):
    """ExpertCalls that parse, with every field free: answered, or INVALID_ARGUMENT for their id."""
    call = expert_pb2.ExpertCall(
        call_id=7,
        layer=layer,
        hidden=tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data),
        expert_ids=tensor_pb2.Tensor(
            dtype=ids_dtype, shape=ids_shape, data=np.array(ids, dtype=np.int32).tobytes()
        ),
    )
    assert targets["expert_call"].run(call.SerializeToString()) in ("accepted", "refused")


def test_a_claimed_frame_size_allocates_only_what_arrives():
    """A header announcing a frame just under the cap, then a few bytes: the reader holds no more
    than its first buffer; one over the cap is refused before any body is read."""
    reader, writer = socket.socketpair()
    with reader, writer:
        writer.sendall(HEADER.pack(CALL_CAP * 64 - 1) + b"x" * 100)
        writer.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            with pytest.raises(FrameError):
                read_call(reader, CALL_CAP * 64)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < FIRST_ALLOCATION + (256 << 10), peak
    reader, writer = socket.socketpair()
    with reader, writer:
        writer.sendall(HEADER.pack(CALL_CAP + 1))
        with pytest.raises(FrameError, match="over the"):
            read_call(reader, CALL_CAP)


@pytest.mark.slow
def test_a_worker_keeps_answering_good_calls_between_bad_ones(split, short_tmp):
    """A real worker process: 300 mutated frames, each on a connection of its own (a bad frame
    closes its connection), interleaved with good calls on one connection that stays open; every
    good call's answer equals the first one, and the worker still serves at the end."""
    workers = Workers(split, short_tmp, ["2-5"]).start()
    try:
        path = frames_path_for(workers.addresses[0].removeprefix("unix:"))
        calls = expert_call_seeds(Manifest.load(split).hidden_size, [2, 5])
        good, seeds = calls[0], [frame(call) for call in calls]
        rng = random.Random(3)
        steady = socket.socket(socket.AF_UNIX)
        steady.connect(path)
        with steady:
            first = _round_trip(steady, good)
            assert not first.HasField("error")
            for i in range(300):
                with socket.socket(socket.AF_UNIX) as hostile:
                    hostile.connect(path)
                    hostile.settimeout(10)  # answers in-band, or closes: never hangs
                    try:
                        hostile.sendall(mutate_bytes(rng.choice(seeds), seeds, rng))
                        hostile.shutdown(socket.SHUT_WR)
                        while hostile.recv(65536):
                            pass
                    except (ConnectionResetError, BrokenPipeError):
                        pass  # closed by the worker with bytes unread: a refusal
                if i % 10 == 0:
                    answer = _round_trip(steady, good)
                    assert answer.output == first.output and not answer.HasField("error")
        assert workers.procs[0].poll() is None
    finally:
        workers.stop()


def _round_trip(sock: socket.socket, call: bytes) -> expert_pb2.ExpertResult:
    sock.sendall(frame(call))
    (size,) = struct.unpack("<I", _exact(sock, 4))
    return expert_pb2.ExpertResult.FromString(_exact(sock, size))


def _exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the worker closed the good connection"
        data += chunk
    return data
