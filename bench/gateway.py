"""Latency the gateway adds per streamed token: HTTP + SSE + the extra gRPC hop, vs calling core directly.

    python bench/gateway.py [--tokens 1000] [--rounds 3] [--interval-ms 2]

Three processes, as in production: a Core gRPC server on a Unix socket, the real gateway
(`run_gateway`, uvicorn + uvloop) in front of it, and this client. The core here is a paced streamer
that speaks the real `Core.Generate` protocol: it sends `--tokens` one-token chunks, one every
`--interval-ms`, each carrying its send time (CLOCK_MONOTONIC, shared by every process on the host)
as its text. Model compute is left out on purpose: it is the same on both paths and its jitter
(milliseconds per token on this CPU) would bury a difference of microseconds.

For every token the client records arrival − send time, reading the stream three ways, interleaved
round by round: directly from core (grpc.aio, as the gateway itself reads it); through the gateway
with a minimal HTTP/1.1 reader (`gateway`: the gateway's own cost, the number the target is for);
and through the gateway with httpx (`gateway_httpx`: what an `openai`-client user sees, including
httpx's pure-Python HTTP parsing). Every path parses each chunk (protobuf or the SSE chunk's JSON). Added latency per token = p50(gateway) − p50(direct), per round, median over the rounds (the
pooled percentiles are printed too); the target is ≤ 200 µs.
A second, unpaced pass streams as fast as core can send and reports the wall time per token on each
path: the gateway's throughput cost per token when tokens arrive back to back.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.workdir import bench_workdir

BODY = {"model": "paced", "messages": [{"role": "user", "content": "go"}], "stream": True}


def serve_core(address: str) -> None:
    """The paced Core: `max_tokens` chunks, `temperature` (misused as the interval in seconds) apart."""
    import grpc
    import uvloop
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

    class PacedCore(core_pb2_grpc.CoreServicer):
        async def Generate(self, request, context):
            tokens = request.stopping.max_tokens
            interval = request.sampling.temperature  # the bench's knob; 0 = as fast as possible
            for index in range(tokens):
                if interval:
                    await asyncio.sleep(interval)
                yield core_pb2.GenerateChunk(text=f"{time.monotonic_ns()} ", token_ids=[index])
            yield core_pb2.GenerateChunk(
                finish_reason=core_pb2.LENGTH, usage=core_pb2.Usage(prompt_tokens=1, completion_tokens=tokens)
            )

        async def ListModels(self, request, context):
            return core_pb2.ListModelsResponse(models=[core_pb2.ModelInfo(id="paced")])

    async def main() -> None:
        server = grpc.aio.server()
        core_pb2_grpc.add_CoreServicer_to_server(PacedCore(), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        server.add_insecure_port(address)
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def direct_stream(address: str, tokens: int, interval_s: float) -> tuple[list[float], float]:
    """(per-token latency in µs, wall seconds) reading Core.Generate directly."""
    import grpc

    from services.common.grpc_util import normalize_address
    from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

    request = core_pb2.GenerateRequest(
        sampling=core_pb2.SamplingParams(temperature=interval_s),
        stopping=core_pb2.StoppingCriteria(max_tokens=tokens),
    )
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(normalize_address(address)) as channel:
        started = time.perf_counter()
        async for chunk in core_pb2_grpc.CoreStub(channel).Generate(request, timeout=600):
            now = time.monotonic_ns()
            if chunk.text:
                latencies.append((now - int(chunk.text)) / 1000)
        wall = time.perf_counter() - started
    return latencies, wall


async def gateway_stream(url: str, tokens: int, interval_s: float) -> tuple[list[float], float]:
    """(per-token latency in µs, wall seconds) reading the gateway's SSE stream."""
    import httpx

    body = {**BODY, "max_tokens": tokens, "temperature": interval_s}
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic_ns()
                content = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if content:
                    latencies.append((now - int(content)) / 1000)
        wall = time.perf_counter() - started
    return latencies, wall


async def raw_gateway_stream(url: str, tokens: int, interval_s: float) -> tuple[list[float], float]:
    """Like `gateway_stream`, but reading HTTP/1.1 chunked SSE straight off the socket, so the client's
    own HTTP library (h11 inside httpx) is not counted as gateway time."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({**BODY, "max_tokens": tokens, "temperature": interval_s}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + payload)
    status = await reader.readline()
    assert b" 200 " in status, status
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers
    pending = b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        data = await reader.readexactly(size + 2)
        now = time.monotonic_ns()
        pending += data[:-2]
        *frames, pending = pending.split(b"\n\n")
        for frame in frames:
            if frame.startswith(b"data: {"):
                content = json.loads(frame[6:])["choices"][0]["delta"].get("content")
                if content:
                    latencies.append((now - int(content)) / 1000)
    writer.close()
    return latencies, time.perf_counter() - started


def percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p50), 1), "p90": round(float(p90), 1), "p99": round(float(p99), 1)}


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited: {process.stderr.read() if process.stderr else ''}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("gateway not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval-ms", type=float, default=2.0, help="core's pace between tokens")
    parser.add_argument("--serve-core", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_core:
        serve_core(args.serve_core)
        return

    import uvloop

    workdir = bench_workdir("mm-bench-gw-")
    address = f"unix:{workdir / 'core.sock'}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    core = subprocess.Popen(
        [sys.executable, __file__, "--serve-core", address],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env=env,
        text=True,
    )
    gateway_code = (
        "from services.gateway.server import run_gateway; "
        f"run_gateway('127.0.0.1', {port}, {address!r}, log_level='warning')"
    )
    gateway = subprocess.Popen(
        [sys.executable, "-c", gateway_code], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert core.stdout is not None and core.stdout.readline().strip() == "ready"
        wait_http(url, gateway)
        interval_s = args.interval_ms / 1000
        paths = {"direct": direct_stream, "gateway": raw_gateway_stream, "gateway_httpx": gateway_stream}
        paced: dict[str, list[float]] = {name: [] for name in paths}
        round_deltas: dict[str, list[float]] = {"gateway": [], "gateway_httpx": []}
        unpaced: dict[str, list[float]] = {name: [] for name in paths}
        loop = uvloop.new_event_loop()
        loop.run_until_complete(gateway_stream(url, 50, 0))  # warm-up: connections, imports, JIT caches
        loop.run_until_complete(direct_stream(address, 50, 0))
        for _ in range(args.rounds):
            round_p50: dict[str, float] = {}
            for name, run in paths.items():
                target = address if name == "direct" else url
                latencies, _ = loop.run_until_complete(run(target, args.tokens, interval_s))
                assert len(latencies) == args.tokens, (name, len(latencies))
                paced[name].extend(latencies[1:])  # the first token also pays for the request itself
                round_p50[name] = percentiles(latencies[1:])["p50"]
                _, wall = loop.run_until_complete(run(target, args.tokens, 0))
                unpaced[name].append(wall / args.tokens * 1e6)
            for name in round_deltas:
                round_deltas[name].append(round_p50[name] - round_p50["direct"])
        token_latency = {name: percentiles(values) for name, values in paced.items()}
        direct = token_latency["direct"]
        result = {
            "bench": "gateway",
            "tokens_per_stream": args.tokens,
            "rounds": args.rounds,
            "core_interval_ms": args.interval_ms,
            "token_latency_us": token_latency,
            "added_latency_per_token_us": {
                name: {key: round(token_latency[name][key] - direct[key], 1) for key in direct}
                for name in round_deltas
            },
            # Each round's p50 difference (the paths run back to back): robust to load bursts from
            # other processes, which hit one round and not the rest.
            "added_p50_per_round_us": {
                name: [round(d, 1) for d in deltas] for name, deltas in round_deltas.items()
            },
            "added_p50_median_of_rounds_us": {
                name: round(sorted(deltas)[len(deltas) // 2], 1) for name, deltas in round_deltas.items()
            },
            "unpaced_wall_per_token_us": {name: round(min(walls), 1) for name, walls in unpaced.items()},
            "target_added_p50_us": 200,
        }
        result["meets_target"] = result["added_p50_median_of_rounds_us"]["gateway"] <= 200
        result["load_average_1m"] = round(os.getloadavg()[0], 2)  # other work on the host skews it
        print(json.dumps(result))
    finally:
        for process in (gateway, core):
            process.terminate()
        for process in (gateway, core):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
