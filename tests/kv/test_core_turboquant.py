"""A real core process launched with --kv-cache turboquant, over real expert workers:
its greedy tokens equal mlx-lm's generate_step over the same TurboQuant cache, and a
request may still ask for fp16."""

from __future__ import annotations

import grpc
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from services.core.kv import KVCacheSettings, make_kv_cache
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import Workers, short_dir, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

SETTINGS = KVCacheSettings(recent_window=8)  # compresses all but the newest 8-71 tokens
PROMPT = [(i * 37) % 5000 + 200 for i in range(150)]


@pytest.fixture(scope="module")
def core(tiny_models):
    workdir = short_dir()
    split = tiny_models.split("qwen3_moe", None)
    workers = Workers(split, workdir, ["0-7"]).start()
    address = f"unix:{workdir / 'core.sock'}"
    argv = ["core", "--split", str(split), "--listen", address, "--worker", ",".join(workers.addresses)]
    # the prompt in chunks of at most 37 tokens (and whatever the step-time pacer cuts), where
    # generate_step prefills all 150 at once: TurboQuant's tokens must not depend on chunking
    flags = ["--kv-cache", "turboquant", "--kv-recent-window", "8", "--max-num-batched-tokens", "37"]
    proc = spawn([*argv, *flags], workdir / "core.log")
    wait_serving(address, timeout_s=60)
    yield address, tiny_models.checkpoint("qwen3_moe", None)
    stop([proc])
    workers.stop()


def local_greedy(checkpoint, kind: str, n: int) -> list[int]:
    model, _ = mlx_lm.load(str(checkpoint))
    cache = make_kv_cache(model, kind, SETTINGS)
    return [t for t, _ in generate_step(mx.array(PROMPT), model, prompt_cache=cache, max_tokens=n)]


async def remote_greedy(address: str, kind: str, n: int, cached: list | None = None) -> list[int]:
    request = core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=PROMPT),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=n, ignore_eos=True),
        kv_cache=kind,
    )
    async with grpc.aio.insecure_channel(address) as channel:
        chunks = [c async for c in core_pb2_grpc.CoreStub(channel).Generate(request, timeout=120)]
    if cached is not None:
        cached.append(chunks[-1].usage.cached_prompt_tokens)
    return [t for c in chunks for t in c.token_ids]


async def test_core_serves_turboquant_by_default_and_fp16_on_request(core):
    address, checkpoint = core
    turboquant, fp16 = local_greedy(checkpoint, "turboquant", 12), local_greedy(checkpoint, "fp16", 12)
    assert turboquant != fp16  # on this random tiny model the two caches are told apart
    assert await remote_greedy(address, "", 12) == turboquant
    cached: list[int] = []
    assert await remote_greedy(address, "", 12, cached) == turboquant  # again: from the prefix cache
    assert cached[0] > 0
    assert await remote_greedy(address, "fp16", 12) == fp16


async def test_fp16_core_checks_turboquant_kernels_at_first_use(tiny_models):
    """A core whose default cache is fp16 serves without running the fused kernels' self-check
    (on a fresh CUDA machine it compiles for a minute and more); the first request that asks for
    TurboQuant runs it, keeps its pass, and gets the same tokens as mlx-lm's TurboQuant cache."""
    from metal import cpu_kernels
    from services.core.kv.kernel_check import kernels_pass

    workdir = short_dir()
    split = tiny_models.split("qwen3_moe", None)
    address = f"unix:{workdir / 'core.sock'}"
    flags = ["--worker", "local", "--kv-recent-window", "8"]
    env = {"MOE_MESH_CACHE": str(workdir / "cache")}  # no self-check pass kept from earlier runs
    proc = spawn(["core", "--split", str(split), "--listen", address, *flags], workdir / "core.log", env)
    passes = workdir / "cache" / "selfcheck"
    try:
        wait_serving(address, proc, timeout_s=60, log_path=workdir / "core.log")
        assert not passes.exists()
        tokens = await remote_greedy(address, "turboquant", 12)
        assert tokens == local_greedy(tiny_models.checkpoint("qwen3_moe", None), "turboquant", 12)
        if kernels_pass(cpu_kernels):  # this machine's kernels: their pass is now kept
            assert list(passes.glob("*.passed"))
    finally:
        stop([proc])
