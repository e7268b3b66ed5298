"""Time to first token of one request, by whether its prompt length was seen before.

    python bench/ttft.py [--model qwen3-30b-a3b-4layer|demo|PATH] [--dtype bfloat16]

Core with every expert in its process (`--worker local`) serves single requests one after another
over gRPC, prompts given as token ids (no chat template), greedy, 16 tokens each, none sharing a
prefix with an earlier one (so the prefix cache never answers):

  new_content_same_length   six 24-token prompts
  new_lengths               six prompts of 30..35 tokens, each length new to this core
  seen_lengths              six more of 30..35 tokens, new content, lengths seen once already
  long_new                  three 200-token prompts

Per request: time to first token and the mean gap between later tokens, ms. A backend that
compiles kernels per shape pays it at each new prompt length; the decode gaps are there to show
that the steady state is the same. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import grpc
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import checkpoint, log, spin_as_up, split_system
from bench.workdir import bench_workdir
from services.ops.up import resolve_split
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

CASES = {  # name -> (first token id of each prompt, its length)
    "new_content_same_length": [(2000 + 100 * i, 24) for i in range(6)],
    "new_lengths": [(9000 + 100 * i, 30 + i) for i in range(6)],
    "seen_lengths": [(20000 + 100 * i, 30 + i) for i in range(6)],
    "long_new": [(40000 + 1000 * i, 200) for i in range(3)],
}


def request(first: int, length: int, tokens: int) -> core_pb2.GenerateRequest:
    return core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=list(range(first, first + length))),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=tokens, ignore_eos=True),
    )


async def timed(stub, message) -> tuple[float, float]:
    """(time to first token, mean gap between the later tokens), ms."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    async for chunk in stub.Generate(message, timeout=3600):
        arrivals.extend([time.perf_counter()] * len(chunk.token_ids))
    gap = (arrivals[-1] - arrivals[1]) / (len(arrivals) - 2)
    return round((arrivals[0] - sent) * 1e3, 1), round(gap * 1e3, 2)


async def measure(address: str, tokens: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        for _ in range(3):
            await timed(stub, request(1000, 8, 4))  # warm-up
        out = {}
        for name, prompts in CASES.items():
            runs = [await timed(stub, request(first, length, tokens)) for first, length in prompts]
            out[name] = {"ttft_ms": [r[0] for r in runs], "decode_gap_ms": [r[1] for r in runs]}
            log(f"{name}: {out[name]}")
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b-4layer")
    parser.add_argument("--dtype", default="bfloat16", help="a synthetic shape's dtype")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")  # logs to stderr: stdout carries only the JSON
    path = checkpoint(args.model, args.dtype)
    split = resolve_split(None if args.model == "demo" else str(path))
    flags = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256"]
    with split_system(split, bench_workdir(), 0, spin_as_up(1), flags) as (address, _):
        cases = asyncio.run(measure(address, args.tokens))
    report = {
        "bench": "ttft",
        "machine": f"{platform.system()} {platform.machine()}, mlx {mx.__version__} on {mx.default_device()}",
        "model": args.model,
        **({} if args.model == "demo" else {"dtype": args.dtype}),
        "cases": cases,
        "command": "python bench/ttft.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
