"""Where a burst's time to first token goes: 16 concurrent requests against one core.

    python bench/burst_timeline.py                                   # the demo model, this machine
    python bench/burst_timeline.py --model qwen3-30b-a3b-4layer --dtype bfloat16   # on a GPU

Core serves with its experts in process (`--worker local`) and logs at debug level. Each round sends
16 chat requests at once over gRPC and records when each one's first token arrived (ms after the
first send); the last round's core events follow on the same clock: when core admitted each request
(`generate_start`) and each prefill step's tokens and seconds (`prefill_step`). The first round only
warms up (4 tokens each). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

import grpc
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench.decode as decode
from bench.concurrency import chat, story
from bench.decode import checkpoint, split_system
from bench.workdir import bench_workdir
from services.ops.up import resolve_split
from services.proto.moemesh.v1 import core_pb2_grpc

STREAMS = 16
EVENTS = ("generate_start", "prefill_step")


async def first_token(stub, request) -> float:
    """When the stream's first token arrived. The stream is read to its end, so the next round
    starts on an idle core rather than behind this round's decoding."""
    first = None
    async for chunk in stub.Generate(request, timeout=600):
        if chunk.token_ids and first is None:
            first = time.time()
    if first is None:
        raise RuntimeError("a stream ended without a token")
    return first


async def bursts(address: str, rounds: int, tokens: int) -> tuple[list[dict], float]:
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        for r in range(rounds):
            requests = [chat(story(i, r), tokens if r else 4) for i in range(STREAMS)]
            start = time.time()
            firsts = await asyncio.gather(*(first_token(stub, q) for q in requests))
            out.append({"round": r, "first_token_ms": sorted(round((t - start) * 1e3, 1) for t in firsts)})
    return out, start


def log_records(text: str):
    """The JSON records of a log, where lines written by two threads at once may share a line."""
    decoder = json.JSONDecoder()
    for line in text.splitlines():
        at = line.find("{")
        while at >= 0:
            try:
                record, end = decoder.raw_decode(line, at)
            except json.JSONDecodeError:
                break
            yield record
            at = line.find("{", end)


def core_events(log_path: Path, since: float) -> list[dict]:
    events = []
    for event in log_records(log_path.read_text()):
        if "timestamp" not in event or "event" not in event:
            continue
        stamp = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
        if stamp >= since and event["event"] in EVENTS:
            keep = {k: event[k] for k in ("prompt_tokens", "tokens", "decoding", "seconds") if k in event}
            events.append({"t_ms": round((stamp - since) * 1e3, 2), "event": event["event"], **keep})
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="float32", help="synthetic models' dtype (bfloat16 on GPUs)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--core-flags", default="", help="more `moe-mesh core` flags, e.g. --burst-gather-ms 0"
    )
    args = parser.parse_args()
    split = resolve_split(None if args.model == "demo" else str(checkpoint(args.model, args.dtype)))
    spawn = decode.spawn  # core logs JSON at debug level: its prefill steps and admissions
    decode.spawn = lambda argv, *a, **k: spawn(
        ["--log-level", "debug", "--log-format", "json", *argv], *a, **k
    )
    workdir = bench_workdir("mm-burst-")
    flags = ["--max-num-seqs", str(STREAMS), "--max-num-batched-tokens", "256", *args.core_flags.split()]
    with split_system(split, workdir, 0, 0, flags) as (address, _):
        rounds, last_start = asyncio.run(bursts(address, args.rounds, args.tokens))
    report = {
        "bench": "burst_timeline",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "model": args.model,
        "streams": STREAMS,
        "core_flags": args.core_flags,
        "rounds": rounds,
        "core_events_last_round": core_events(workdir / "core0.log", last_start),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
