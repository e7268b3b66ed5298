"""`--max-model-len`: core serves a shorter context than the model's, as vLLM's flag does, and
refuses a longer one at start-up with one line that names both lengths."""

from __future__ import annotations

import grpc
import pytest

from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import run_cli, short_dir, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds


async def test_core_serves_the_shorter_context(tiny_models):
    workdir = short_dir()
    split = tiny_models.split("qwen3_moe", None)
    address = f"unix:{workdir / 'core.sock'}"
    argv = ["core", "--split", str(split), "--listen", address, "--worker", "local", "--max-model-len", "64"]
    proc = spawn(argv, workdir / "core.log")
    try:
        wait_serving(address, proc, timeout_s=60, log_path=workdir / "core.log")
        async with grpc.aio.insecure_channel(address) as channel:
            stub = core_pb2_grpc.CoreStub(channel)
            (model,) = (await stub.ListModels(core_pb2.ListModelsRequest())).models
            assert model.context_length == 64
            assert model.images_refused == "takes text only"  # the gateway refuses images up front
            fits = core_pb2.GenerateRequest(
                token_ids=core_pb2.TokenIds(ids=list(range(100, 150))),
                stopping=core_pb2.StoppingCriteria(max_tokens=14, ignore_eos=True),
            )
            chunks = [chunk async for chunk in stub.Generate(fits, timeout=60)]
            assert sum(len(chunk.token_ids) for chunk in chunks) == 14
            fits.stopping.max_tokens = 15  # 50 + 15 > 64
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [chunk async for chunk in stub.Generate(fits, timeout=60)]
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "context_length_exceeded" in refused.value.details() and "64" in refused.value.details()
    finally:
        stop([proc])


def test_a_context_longer_than_the_models_is_refused(tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    workdir = short_dir()
    argv = ["core", "--split", str(split), "--listen", f"unix:{workdir / 'c.sock'}", "--worker", "local"]
    out = run_cli(*argv, "--max-model-len", "1000000", timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "--max-model-len 1000000 is longer than the model's context (4096 tokens" in last
