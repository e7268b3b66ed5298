"""Real worker processes with `--memory-gb`: RSS through a 256-token generation, read failures.

The RSS check runs the whole system (core + one streaming worker, real processes over Unix
sockets) on a model whose routed experts are 4x the worker's budget, and compares the
tokens with mlx-lm's own greedy generation of the same checkpoint.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from services.common import tensor_codec
from services.common.manifest import Manifest
from services.experts.streaming_store import expert_bytes
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc, expert_pb2, expert_pb2_grpc
from services.tools.split import split_checkpoint
from services.tools.synthetic_model import TINY_CONFIGS, build_random_checkpoint
from tests.helpers import REPO, spawn, stop, wait_serving

# What a streaming worker needs besides its expert budget, measured on this Linux VM: ~95 MB for
# Python, MLX, numpy, gRPC and the expert module skeleton, plus the call's activations and the
# I/O threads. A fully resident worker of the model below needs ~300 MB and fails this bound.
FIXED_OVERHEAD_MB = 160
BUDGET_GB = 0.05

# 4 MoE layers x 32 experts of 1.57 MB (float32): 201 MB of experts, 4x the 50 MB budget.
BIG_EXPERTS = {
    **TINY_CONFIGS["qwen3_moe"],
    "hidden_size": 128,
    "head_dim": 32,
    "moe_intermediate_size": 1024,
    "num_experts": 32,
    "tie_word_embeddings": True,
}
PROMPT = [9, 302, 17, 4000, 1234, 56, 789, 2048, 11, 3]

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc (Linux only)"),
    pytest.mark.slow,  # starts processes
]


def rss_mb(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def describe(address: str) -> expert_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return expert_pb2_grpc.ExpertWorkerStub(channel).Describe(expert_pb2.DescribeRequest(), timeout=10)


def test_rss_stays_under_budget_through_256_tokens_with_experts_4x_the_budget(tmp_path, short_tmp):
    checkpoint = build_random_checkpoint(tmp_path / "ckpt", BIG_EXPERTS)
    split = tmp_path / "split"
    manifest = split_checkpoint(checkpoint, split, progress=False)
    experts_total = sum(expert_bytes(layer) * layer.num_experts for layer in manifest.layers)
    assert experts_total >= 4 * BUDGET_GB * 1e9

    worker_address, core_address = f"unix:{short_tmp / 'w.sock'}", f"unix:{short_tmp / 'core.sock'}"
    worker = spawn(
        [
            "expert",
            "--split",
            str(split),
            "--listen",
            worker_address,
            "--memory-gb",
            str(BUDGET_GB),
            "--io",
            "direct",
        ],
        short_tmp / "w.log",
    )
    core = None
    try:
        wait_serving(worker_address, worker, log_path=short_tmp / "w.log")
        core = spawn(
            ["core", "--split", str(split), "--listen", core_address, "--worker", worker_address],
            short_tmp / "core.log",
        )
        wait_serving(core_address, core, log_path=short_tmp / "core.log")
        request = core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=PROMPT),
            sampling=core_pb2.SamplingParams(temperature=0),
            stopping=core_pb2.StoppingCriteria(max_tokens=256, ignore_eos=True),
        )

        async def generate() -> list[int]:
            tokens = []
            async with grpc.aio.insecure_channel(core_address) as channel:
                async for chunk in core_pb2_grpc.CoreStub(channel).Generate(request, timeout=300):
                    tokens.extend(chunk.token_ids)
            return tokens

        tokens = asyncio.run(generate())
        current, peak = rss_mb(worker.pid)
        stats = describe(worker_address)
    finally:
        stop([p for p in (core, worker) if p is not None])

    model, _ = load_model(checkpoint)
    expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=256)]
    assert tokens == expected
    budget_mb = BUDGET_GB * 1e9 / 2**20
    assert peak <= budget_mb + FIXED_OVERHEAD_MB, f"peak RSS {peak} MB (now {current} MB)"
    assert stats.memory_budget_bytes == int(BUDGET_GB * 1e9)
    assert stats.resident_bytes <= stats.memory_budget_bytes
    assert stats.cache_slots == 31  # 50 MB / 1.57 MB
    # It really streamed: far more bytes than the budget went through the slots.
    assert stats.bytes_read >= 4 * stats.memory_budget_bytes
    assert stats.cache_misses * expert_bytes(manifest.layers[0]) <= stats.bytes_read
    assert stats.cache_hits > 0 and stats.read_failures == 0 and stats.read_gbps > 0


@pytest.mark.parametrize("segment_kb", [None, "4"])  # whole records; two segments per record
def test_damaged_layer_file_at_start_and_while_serving(tiny_models, tmp_path, short_tmp, segment_kb):
    split = tmp_path / "split"
    shutil.copytree(tiny_models.split("qwen3_moe", 4), split)
    manifest = Manifest.load(split)
    layer = manifest.layer(1)
    layer_file = split / layer.file
    original = layer_file.read_bytes()
    budget = str(3 * expert_bytes(layer) * len(manifest.layers) / 1e9)

    # Truncated before start: one line naming the file, no traceback, nonzero exit.
    layer_file.write_bytes(original[: 5 * layer.record_size])
    refused = subprocess.run(
        [sys.executable, "-m", "services.ops.cli", "expert", "--split", str(split), "--memory-gb", budget],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0
    assert "layer_001.bin" in refused.stderr and "truncated" in refused.stderr
    assert "Traceback" not in refused.stderr

    # Truncated while serving: the call needing a lost expert fails naming it; the worker stays up.
    layer_file.write_bytes(original)
    address = f"unix:{short_tmp / 'w.sock'}"
    segments = ["--io-segment-kb", segment_kb] if segment_kb else []
    worker = spawn(
        ["expert", "--split", str(split), "--listen", address, "--memory-gb", budget, *segments],
        short_tmp / "w.log",
    )
    try:
        wait_serving(address, worker, log_path=short_tmp / "w.log")
        with open(layer_file, "r+b") as f:
            f.truncate(6 * layer.record_size + 4096)  # expert 6 keeps its first page; 7 is gone
        hidden = mx.array(np.random.RandomState(0).normal(size=(1, manifest.hidden_size)).astype(np.float32))

        def call(call_id: int, experts: list[int]) -> expert_pb2.ExpertCall:
            ids = mx.array(np.array([experts], dtype=np.int32))
            return expert_pb2.ExpertCall(
                call_id=call_id,
                layer=1,
                hidden=tensor_codec.encode(hidden),
                expert_ids=tensor_codec.encode(ids),
            )

        with grpc.insecure_channel(address) as channel:
            stub = expert_pb2_grpc.ExpertWorkerStub(channel)
            replies = list(
                stub.Forward(iter([call(1, [0, 7]), call(2, [0, 5]), call(3, [6, 1])]), timeout=30)
            )
            stats = stub.Describe(expert_pb2.DescribeRequest(), timeout=10)
        failed, served, failed_again = replies
        assert failed.error.code == grpc.StatusCode.INTERNAL.value[0]
        assert "layer_001.bin" in failed.error.message and "expert 7 of layer 1" in failed.error.message
        assert not failed.HasField("output")
        assert served.error.code == 0 and list(served.output.shape) == [2, manifest.hidden_size]
        assert "expert 6 of layer 1" in failed_again.error.message
        assert stats.read_failures == 2 and worker.poll() is None
    finally:
        stop([worker])
