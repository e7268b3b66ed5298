"""When its last sequence leaves, core gives back what only running sequences needed: the
batches, MLX's freed buffers and the heap's free pages (engine.release_idle_memory)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import core_args, greedy_ids, spawn, stop, wait_serving

pytestmark = pytest.mark.slow


def test_an_idle_core_holds_no_freed_buffers_and_serves_the_same_tokens_again(tiny_models, short_tmp):
    split = tiny_models.split("qwen3_moe", None)
    address, log_path = f"unix:{short_tmp / 'core.sock'}", short_tmp / "core.log"
    core = spawn(core_args(split, address, ["local"], "--mlx-cache-gb", "1"), log_path)
    prompts = [[3 + i, 17, 42 + i, 9, 11 + 2 * i] * (i + 2) for i in range(4)]

    async def run() -> tuple[list, list, core_pb2.CoreStats]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = core_pb2_grpc.CoreStub(channel)

            first = await asyncio.gather(*(greedy_ids(stub, p, 8) for p in prompts))
            deadline = time.monotonic() + 10
            while True:  # the engine releases right after its last step, which the reply may beat
                stats = await stub.GetStats(core_pb2.GetStatsRequest(), timeout=10)
                if stats.mlx_cache_bytes == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            again = await asyncio.gather(*(greedy_ids(stub, p, 8) for p in prompts))
            return first, again, stats

    try:
        wait_serving(address, core, log_path=log_path)
        first, again, idle = asyncio.run(run())
        assert idle.running_requests == 0 and idle.kv_cache_bytes == 0
        assert idle.mlx_cache_bytes == 0, f"{idle.mlx_cache_bytes} bytes of freed MLX buffers kept while idle"
        assert all(len(tokens) == 8 for tokens in first)
        assert again == first  # new batches, the same greedy tokens
    finally:
        stop([core])
