"""Shared pieces of the cluster tests: a cluster.toml writer and a core reached over its Unix socket."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import grpc
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from services.common.grpc_util import aio_channel
from services.common.tls import TlsFiles
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.cluster.netns import netns_unavailable
from tests.helpers import health_status

GREEDY = core_pb2.SamplingParams(temperature=0)


@pytest.fixture(scope="session")
def netns_ok():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


def write_cluster_toml(
    path: Path,
    split: Path,
    core_listen: str,
    workers: list[tuple[str, str, str]],
    tls_dir: str | None = None,
    core_metrics: str | None = None,
    worker_metrics: str | None = None,
) -> Path:
    """workers: (name, address, experts)."""
    lines = [
        "[model]",
        f'split = "{split}"',
        "[core]",
        f'listen = "{core_listen}"',
        "expert_timeout_s = 10",
    ]
    if core_metrics:
        lines.append(f'metrics = "{core_metrics}"')
    if tls_dir:
        lines += ["[tls]", f'dir = "{tls_dir}"']
    for name, address, experts in workers:
        lines += ["[[workers]]", f'name = "{name}"', f'address = "{address}"', f'experts = "{experts}"']
        if worker_metrics:
            lines.append(f'metrics = "{worker_metrics}"')
    path.write_text("\n".join(lines) + "\n")
    return path


@functools.cache
def oracle_tokens(checkpoint: Path, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, mlx-lm's own greedy tokens) for the checkpoint."""
    model, tokenizer = mlx_lm.load(str(checkpoint))
    ids = tokenizer.encode(prompt)
    return ids, [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens)]


class CoreClient:
    """Test-side client of a core listening on a Unix socket (optionally mTLS)."""

    def __init__(self, address: str, tls: TlsFiles | None = None):
        self.address, self.tls = address, tls

    def channel(self) -> grpc.aio.Channel:
        return aio_channel(self.address, self.tls)

    async def health(self) -> int:
        async with self.channel() as channel:
            return await health_status(channel)

    async def wait_health(self, status: int, timeout_s: float = 90.0, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.health() == status:
                return
            await asyncio.sleep(0.1)
        tail = log.read_text()[-3000:] if log else ""
        raise AssertionError(f"core health never became {status}: {tail}")

    async def stats(self) -> core_pb2.CoreStats:
        async with self.channel() as channel:
            return await core_pb2_grpc.CoreStub(channel).GetStats(core_pb2.GetStatsRequest(), timeout=5)

    def request(self, ids: list[int], max_tokens: int, request_id: str = "") -> core_pb2.GenerateRequest:
        return core_pb2.GenerateRequest(
            request_id=request_id,
            token_ids=core_pb2.TokenIds(ids=ids),
            sampling=GREEDY,
            stopping=core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        )

    async def tokens(self, request: core_pb2.GenerateRequest, timeout: float = 60) -> list[int]:
        async with self.channel() as channel:
            stream = core_pb2_grpc.CoreStub(channel).Generate(request, timeout=timeout)
            return [t async for chunk in stream for t in chunk.token_ids]
