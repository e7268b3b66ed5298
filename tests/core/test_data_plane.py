"""The in-graph data plane (`--distributed ring`): core and two worker processes in one MLX group.

The ring backend over loopback TCP stands in for NCCL and JACCL: the same collectives, the same
code. Greedy tokens must equal mlx-lm's own generation on the same checkpoint, with the layer
calls carried by the group (core makes no gRPC or frame hop), and a member lost mid-service must
leave core serving over gRPC.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from services.common.data_plane_flag import DATA_PLANE_STUCK
from services.ops.up import data_plane_envs
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc, expert_pb2, expert_pb2_grpc
from tests.helpers import Workers, core_args, short_dir, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

GREEDY = core_pb2.SamplingParams(temperature=0)
CORE_EXTRA: tuple = ()
PROMPT = [3, 17, 42, 7, 99, 5]


class PlaneStack:
    """Two workers (expert ranges `ranges`) and a core, all in one ring group."""

    def __init__(self, split, ranges: list[str]):
        self.workdir = short_dir()
        envs = data_plane_envs(self.workdir, "ring", len(ranges) + 1)
        plane = ("--distributed", "ring")
        self.workers = Workers(split, self.workdir, ranges, extra_args=plane, envs=envs[1:]).start()
        self.core_address = f"unix:{self.workdir / 'core.sock'}"
        self.core_log = self.workdir / "core.log"
        self.core = spawn(
            core_args(
                split,
                self.core_address,
                self.workers.addresses,
                "--expert-timeout",
                "10",
                *plane,
                *CORE_EXTRA,
            ),
            self.core_log,
            envs[0],
        )
        wait_serving(self.core_address, self.core, timeout_s=120, log_path=self.core_log)

    def close(self) -> None:
        stop([self.core])
        self.workers.stop()

    async def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        request = core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=prompt),
            sampling=GREEDY,
            stopping=core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        )
        async with grpc.aio.insecure_channel(self.core_address) as channel:
            chunks = core_pb2_grpc.CoreStub(channel).Generate(request, timeout=60)
            return [t async for chunk in chunks for t in chunk.token_ids]

    async def layer_calls(self) -> int:
        """Layer calls core made over gRPC or frames (the plane's are not hops it times)."""
        async with grpc.aio.insecure_channel(self.core_address) as channel:
            stats = await core_pb2_grpc.CoreStub(channel).GetStats(core_pb2.GetStatsRequest(), timeout=10)
            return stats.layer_calls.calls

    async def ranks(self) -> list[int]:
        out = []
        for address in self.workers.addresses:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = expert_pb2_grpc.ExpertWorkerStub(channel)
                out.append((await stub.Describe(expert_pb2.DescribeRequest(), timeout=10)).data_plane_rank)
        return out


def mlx_lm_tokens(checkpoint, prompt: list[int], max_tokens: int) -> list[int]:
    model, _ = mlx_lm.load(str(checkpoint))
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


@pytest.fixture(scope="module")
def sharded(tiny_models):
    stack = PlaneStack(tiny_models.split("qwen3_moe", None), ["0-3", "4-7"])
    yield stack
    stack.close()


async def test_greedy_tokens_equal_mlx_lm_with_calls_in_the_graph(sharded, tiny_models):
    """Each worker computes its own experts' pairs and zeros elsewhere; the sums are exact."""
    assert await sharded.ranks() == [1, 2]
    want = mlx_lm_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 12)
    assert await sharded.generate(PROMPT, 12) == want
    assert await sharded.layer_calls() == 0  # every call rode the group, none a hop


async def test_batched_requests_each_equal_their_solo_run(sharded):
    """Prefill chunks and decodes of several sequences in one step: several forwards, each with
    its own exchanges, in the order their collectives were built."""
    prompts = [PROMPT, [11, 12, 13], [5] * 9, [2, 4, 6, 8]]
    solo = [await sharded.generate(p, 6) for p in prompts]
    together = await asyncio.gather(*(sharded.generate(p, 6) for p in prompts))
    assert list(together) == solo
    assert await sharded.layer_calls() == 0


@pytest.fixture
def single(tiny_models):
    stack = PlaneStack(tiny_models.split("qwen3_moe", None), ["0-7"])
    yield stack
    stack.close()


def core_log_tail(stack: PlaneStack) -> str:
    """Core's last log lines, without the ring backend's repeated complaints about the lost peer."""
    lines = stack.core_log.read_text().splitlines()
    return "\n".join([line for line in lines if not line.startswith("[ring]")][-40:])


async def serves_on_over_grpc_unless_stuck(stack: PlaneStack, want: list[int]) -> None:
    """After a member was lost: core either serves `want` over gRPC (UNAVAILABLE while no worker
    holds an expert), or has exited DATA_PLANE_STUCK because MLX's ring left a step blocked."""
    deadline = time.monotonic() + 60
    while stack.core.poll() is None:
        try:
            tokens = await stack.generate(PROMPT, 8)
        except grpc.aio.AioRpcError as error:
            log_tail = core_log_tail(stack)
            assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.details(), log_tail)
            assert time.monotonic() < deadline, (error.details(), log_tail)
            await asyncio.sleep(0.5)
            continue
        assert tokens == want
        assert await stack.layer_calls() > 0  # now over gRPC
        return
    stuck = stack.core.returncode == DATA_PLANE_STUCK and "data_plane_stuck" in stack.core_log.read_text()
    assert stuck, core_log_tail(stack)


async def test_a_lost_member_fails_one_step_then_core_serves_over_grpc(single, tiny_models):
    """The worker dies: the step that meets the loss ends UNAVAILABLE within the call deadline.
    MLX's ring either raises (the plane turns off, and once the worker is back core serves over
    gRPC with the same tokens) or blocks the step (core exits 70, for its supervisor)."""
    want = mlx_lm_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 8)
    assert await single.generate(PROMPT, 8) == want
    single.workers.kill(0)
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await single.generate(PROMPT, 8)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value.details()
    assert time.monotonic() - started < 30
    single.workers.envs = [{}]  # a group cannot take a member back: the new worker is gRPC only
    single.workers.start(0)
    await serves_on_over_grpc_unless_stuck(single, want)
    assert "data_plane_lost" in single.core_log.read_text()


@pytest.fixture
def replicated(tiny_models):
    stack = PlaneStack(tiny_models.split("qwen3_moe", None), ["0-7", "0-7"])
    yield stack
    stack.close()


async def test_a_member_lost_between_steps_fails_no_request(replicated, tiny_models):
    """Worker 2 (a replica of every expert) dies while core is idle: core's watch of the members
    turns the plane off before a step meets the loss, and the next requests go over gRPC to the
    surviving replica with the same tokens."""
    want = mlx_lm_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 8)
    assert await replicated.generate(PROMPT, 8) == want
    await asyncio.sleep(1)  # the work MLX started ahead of the last token is done: core is idle
    replicated.workers.kill(1)
    deadline = time.monotonic() + 30
    while "data_plane_lost" not in replicated.core_log.read_text():
        assert time.monotonic() < deadline, "core never noticed the lost member"
        await asyncio.sleep(0.2)
    assert await replicated.generate(PROMPT, 8) == want
    assert await replicated.layer_calls() > 0  # now over gRPC


async def test_a_member_lost_mid_generation_never_hangs_a_request(replicated, tiny_models):
    """Worker 2 dies while core decodes. MLX's ring may raise (the step fails UNAVAILABLE, core
    serves on over gRPC) or block the step for ever (core exits 70 once the step outlives the call
    deadline, for its supervisor to restart it). Either way the request ends."""
    want = mlx_lm_tokens(tiny_models.checkpoint("qwen3_moe", None), PROMPT, 8)
    decoding = asyncio.create_task(replicated.generate(PROMPT, 400))
    await asyncio.sleep(0.5)
    replicated.workers.kill(1)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await asyncio.wait_for(decoding, 40)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value.details()
    await serves_on_over_grpc_unless_stuck(replicated, want)
