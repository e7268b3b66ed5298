"""A real expert worker process: Describe, Forward, and every kind of malformed call."""

from __future__ import annotations

import asyncio
import time

import grpc
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from services.common import tensor_codec
from services.common.model_build import expert_modules
from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc, tensor_pb2
from tests.helpers import Workers, health_status, short_dir

H = 64  # tiny models' hidden size
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def worker(tiny_models, tmp_path_factory):

    split = tiny_models.split("qwen3_moe", None)
    workers = Workers(split, short_dir(), ["2-5"]).start()
    yield workers, split
    workers.stop()


def good_call(call_id: int, tokens: int = 3, experts=(2, 5)) -> expert_pb2.ExpertCall:
    hidden = mx.random.normal((tokens, H))
    ids = mx.array(np.array([list(experts)] * tokens, dtype=np.int32))
    return expert_pb2.ExpertCall(
        call_id=call_id, layer=1, hidden=tensor_codec.encode(hidden), expert_ids=tensor_codec.encode(ids)
    )


def malformed_calls():
    calls = {}

    def variant(name, mutate):
        call = good_call(100 + len(calls))
        mutate(call)
        calls[f"{name} #{len(calls)}"] = call

    variant("layer", lambda c: setattr(c, "layer", 77))
    variant(
        "expert_ids",
        lambda c: c.expert_ids.CopyFrom(tensor_codec.encode(mx.array([[0, 2]] * 3, dtype=mx.int32))),
    )
    variant(
        "expert_ids",
        lambda c: c.expert_ids.CopyFrom(tensor_codec.encode(mx.array([[2, 99]] * 3, dtype=mx.int32))),
    )
    calls["expert_ids (< -1)"] = good_call(150)
    calls["expert_ids (< -1)"].expert_ids.CopyFrom(
        tensor_codec.encode(mx.array([[2, -7]] * 3, dtype=mx.int32))
    )
    variant(
        "hidden.dtype", lambda c: c.hidden.CopyFrom(tensor_codec.encode(mx.zeros((3, H), dtype=mx.int32)))
    )
    variant("hidden", lambda c: setattr(c.hidden, "data", c.hidden.data[:-4]))  # byte count off
    variant("hidden", lambda c: c.hidden.shape.extend([1]))  # wrong rank
    variant("hidden", lambda c: c.hidden.shape.__setitem__(0, -3))
    variant("hidden", lambda c: c.hidden.shape.__setitem__(0, 1 << 40))  # over the size cap
    variant("hidden", lambda c: (c.hidden.shape.__setitem__(0, 0), c.hidden.shape.__setitem__(1, 1 << 62)))
    # an empty tensor with a huge dimension: zero bytes, but no array can have that shape
    variant(
        "hidden", lambda c: c.hidden.CopyFrom(tensor_pb2.Tensor(dtype=c.hidden.dtype, shape=[0, 1 << 62]))
    )
    variant("expert_ids", lambda c: setattr(c.expert_ids, "dtype", 0))  # unset dtype
    variant(
        "expert_ids.dtype", lambda c: c.expert_ids.CopyFrom(tensor_codec.encode(mx.array([[2.0, 5.0]] * 3)))
    )
    variant(
        "expert_ids.shape",
        lambda c: c.expert_ids.CopyFrom(tensor_codec.encode(mx.array([[2, 5]] * 2, dtype=mx.int32))),
    )
    variant("hidden.shape", lambda c: c.hidden.CopyFrom(tensor_codec.encode(mx.zeros((3, 32)))))
    return calls


@pytest.mark.slow
async def test_describe(worker):
    workers, split = worker
    async with grpc.aio.insecure_channel(workers.addresses[0]) as channel:
        reply = await expert_pb2_grpc.ExpertWorkerStub(channel).Describe(
            expert_pb2.DescribeRequest(), timeout=5
        )
    from services.common.manifest import Manifest

    assert reply.model_fingerprint == Manifest.load(split).fingerprint
    assert [(l.layer, list(l.experts)) for l in reply.layers] == [(i, [2, 3, 4, 5]) for i in range(4)]
    assert all(all(l.resident) for l in reply.layers)
    assert reply.resident_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [4, 300])  # a decode-sized call, and a prefill chunk (on a thread)
async def test_forward_matches_mlx_lm_expert_module(worker, tiny_models, tokens):
    workers, _ = worker
    model, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    switch = dict(expert_modules(model))["model.layers.1.mlp.switch_mlp"]
    call = good_call(1, tokens=tokens)
    async with grpc.aio.insecure_channel(workers.addresses[0]) as channel:
        stream = expert_pb2_grpc.ExpertWorkerStub(channel).Forward()
        await stream.write(call)
        result = await stream.read()
        await stream.done_writing()
    assert result.call_id == 1 and not result.HasField("error")
    got = tensor_codec.decode(result.output, "output", 1 << 30).reshape(tokens, 2, H)
    want = switch(
        tensor_codec.decode(call.hidden, "h", 1 << 30), tensor_codec.decode(call.expert_ids, "e", 1 << 30)
    )
    assert mx.array_equal(got, want).item()
    assert result.stats.pairs == 2 * tokens and result.stats.compute_us > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
async def test_a_call_is_computed_and_answered_in_its_own_dtype(worker, tiny_models, dtype):
    """Hidden states travel in the dtype core's model computes them in, whatever the weights
    are stored in: the experts see what mlx-lm's own expert module would see."""
    workers, _ = worker
    model, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    switch = dict(expert_modules(model))["model.layers.1.mlp.switch_mlp"]
    call = good_call(2, tokens=4)
    hidden = tensor_codec.decode(call.hidden, "h", 1 << 30).astype(dtype)
    call.hidden.CopyFrom(tensor_codec.encode(hidden))
    async with grpc.aio.insecure_channel(workers.addresses[0]) as channel:
        stream = expert_pb2_grpc.ExpertWorkerStub(channel).Forward()
        await stream.write(call)
        result = await stream.read()
        await stream.done_writing()
    assert not result.HasField("error") and result.output.dtype == call.hidden.dtype
    got = tensor_codec.decode(result.output, "output", 1 << 30).reshape(4, 2, H)
    want = switch(hidden, tensor_codec.decode(call.expert_ids, "e", 1 << 30)).astype(dtype)
    assert got.dtype == dtype and mx.array_equal(got, want).item()


@pytest.mark.slow
async def test_health_and_describe_answer_while_a_long_call_computes(worker):
    """A prefill-sized call is computed off the event loop: the worker's health and Describe
    answer meanwhile (a health check timing out would make a supervisor restart a busy worker)."""
    workers, _ = worker
    big = good_call(3, tokens=150_000)
    options = [("grpc.max_receive_message_length", 1 << 30)]
    async with grpc.aio.insecure_channel(workers.addresses[0], options=options) as channel:
        stream = expert_pb2_grpc.ExpertWorkerStub(channel).Forward()
        await stream.write(big)
        reply = asyncio.ensure_future(stream.read())
        quick, statuses = 0, set()
        while not reply.done():  # health and Describe, again and again, until the reply comes
            started = time.monotonic()
            statuses.add(await health_status(channel))  # 2 s timeout; -1 if it passes
            await expert_pb2_grpc.ExpertWorkerStub(channel).Describe(expert_pb2.DescribeRequest(), timeout=2)
            quick += time.monotonic() - started < 0.25
        result = reply.result()
        await stream.done_writing()
    assert not result.HasField("error") and result.stats.pairs == 300_000
    compute_s = result.stats.compute_us / 1e6
    if compute_s < 1.0:
        pytest.skip(f"the call computed in {compute_s:.2f} s: too fast here to show a stall")
    # Every probe answered within its deadline, and many promptly: a loop blocked for the
    # computation would answer one or two (this client's own handling of the big reply, on a
    # loaded machine, may delay a few).
    assert statuses == {health_pb2.HealthCheckResponse.SERVING}
    assert quick >= 5, (quick, compute_s)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(malformed_calls()))
async def test_malformed_call_is_rejected_and_the_stream_keeps_serving(worker, name):
    workers, _ = worker
    bad = malformed_calls()[name]
    async with grpc.aio.insecure_channel(workers.addresses[0]) as channel:
        stream = expert_pb2_grpc.ExpertWorkerStub(channel).Forward()
        await stream.write(bad)
        rejected = await stream.read()
        await stream.write(good_call(7))
        after = await stream.read()
        await stream.done_writing()
    assert rejected.call_id == bad.call_id
    assert rejected.error.code == INVALID_ARGUMENT
    assert rejected.error.message.startswith(name.split(" ")[0]), rejected.error.message
    assert after.call_id == 7 and not after.HasField("error")
    assert tuple(after.output.shape) == (6, H)
    assert workers.procs[0].poll() is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--experts", "0-99"], "--experts: '0-99' is outside 0-7"),
        (["--layers", "7"], "--layers"),
        (["--experts", "two"], "is not an index or a range"),
    ],
)
def test_bad_ranges_are_refused_in_one_line(tiny_models, short_tmp, flags, message):
    import subprocess
    import sys

    split = tiny_models.split("qwen3_moe", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.ops.cli",
            "expert",
            "--split",
            str(split),
            "--listen",
            f"unix:{short_tmp}/x.sock",
            *flags,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


class _FailingCompute:
    """An ExpertCompute whose math raises, as MLX does for an op it has no kernel for."""

    manifest = None

    def run(self, call):
        raise RuntimeError("[GatherMM::eval] Currently only supports float32.")


@pytest.mark.slow
def test_a_call_whose_math_fails_is_answered_internal_in_band():
    """Forward and the frame socket both answer through `answer()`: a failure of the math is an
    INTERNAL result for that call, not an exception that would end the stream (and, with it,
    core's link to a worker that can serve every other call)."""
    from services.experts.servicer import ExpertWorkerServicer

    servicer = ExpertWorkerServicer(_FailingCompute(), worker_id="w")
    result = servicer.answer(good_call(9))
    assert result.call_id == 9 and result.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "layer 1" in result.error.message and "GatherMM" in result.error.message


@pytest.mark.slow
async def test_bytes_that_do_not_parse_end_the_stream_with_invalid_argument(worker):
    """A message that is not an ExpertCall has no call id to answer in-band: the calls before it
    are answered, the stream ends with INVALID_ARGUMENT (not grpcio's UNKNOWN), and the worker
    serves the next stream."""
    workers, _ = worker
    async with grpc.aio.insecure_channel(workers.addresses[0]) as channel:
        raw = channel.stream_stream(
            "/moemesh.v1.ExpertWorker/Forward",
            request_serializer=lambda message: (
                message if isinstance(message, bytes) else message.SerializeToString()
            ),
            response_deserializer=expert_pb2.ExpertResult.FromString,
        )()
        await raw.write(good_call(1))
        first = await raw.read()
        await raw.write(b"\xff\xff\xff\x07not a call")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await raw.read()
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not parse" in failure.value.details()
        stream = expert_pb2_grpc.ExpertWorkerStub(channel).Forward()
        await stream.write(good_call(2))
        after = await stream.read()
        await stream.done_writing()
    assert first.call_id == 1 and not first.HasField("error")
    assert after.call_id == 2 and not after.HasField("error")
    assert workers.procs[0].poll() is None
