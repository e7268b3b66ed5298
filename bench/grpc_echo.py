"""The floor under every layer call: an ExpertWorker.Forward round trip that does no math.

    python bench/grpc_echo.py

Measures, in fresh processes each, the p50/p99 of one ExpertCall/ExpertResult round trip on a Unix
socket, client side as core does it (streams on an I/O thread running uvloop, hand-off through a
queue): with gRPC's EventEngine client/listener on (grpcio's default) and off (what moe-mesh sets),
and with the server busy 0 or 2.5 ms per call before answering (wake-up latency after a compute).
Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

CALLS = 2000


def serve(address: str, busy_s: float) -> None:
    import grpc
    import uvloop

    from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc

    class Echo(expert_pb2_grpc.ExpertWorkerServicer):
        async def Forward(self, request_iterator, context):
            async for call in request_iterator:
                started = time.perf_counter()
                while time.perf_counter() - started < busy_s:  # busy, as expert math would be
                    pass
                yield expert_pb2.ExpertResult(call_id=call.call_id)

    async def main() -> None:
        server = grpc.aio.server()
        expert_pb2_grpc.add_ExpertWorkerServicer_to_server(Echo(), server)
        server.add_insecure_port(address)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


def client(address: str, busy_s: float) -> dict:
    import grpc
    import numpy as np
    import uvloop

    from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc

    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def open_stream():
        return expert_pb2_grpc.ExpertWorkerStub(grpc.aio.insecure_channel(address)).Forward()

    stream = asyncio.run_coroutine_threadsafe(open_stream(), loop).result()
    replies: queue.SimpleQueue = queue.SimpleQueue()
    call = expert_pb2.ExpertCall(call_id=1)

    async def one() -> None:
        await stream.write(call)
        replies.put(await stream.read())

    def round_trip() -> None:
        loop.call_soon_threadsafe(loop.create_task, one())
        replies.get()

    for _ in range(100):
        round_trip()
    samples = []
    for _ in range(CALLS if busy_s == 0 else CALLS // 4):
        started = time.perf_counter()
        round_trip()
        samples.append((time.perf_counter() - started - busy_s) * 1e6)
    p50, p99 = np.percentile(samples, [50, 99])
    return {"p50_us": round(float(p50), 1), "p99_us": round(float(p99), 1)}


def run_case(event_engine: bool, busy_s: float) -> dict:
    address = f"unix:/tmp/mm-echo-{os.getpid()}.sock"
    env = {
        **os.environ,
        "GRPC_EXPERIMENTS": "" if event_engine else "-event_engine_client,-event_engine_listener",
    }
    here = [sys.executable, str(Path(__file__).resolve())]
    server = subprocess.Popen(
        [*here, "serve", address, str(busy_s)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        server.stdout.readline()
        out = subprocess.run(
            [*here, "client", address, str(busy_s)], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)
    finally:
        server.kill()
        server.wait()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if len(sys.argv) > 1 and sys.argv[1] in ("serve", "client"):
        address, busy_s = sys.argv[2], float(sys.argv[3])
        if sys.argv[1] == "serve":
            serve(address, busy_s)
        else:
            print(json.dumps(client(address, busy_s)))
        return
    report = {"bench": "grpc_echo", "note": "round trip minus the server's busy time, microseconds"}
    for event_engine in (True, False):
        for busy_ms in (0.0, 2.5):
            key = f"event_engine_{'on' if event_engine else 'off'}_busy_{busy_ms}ms"
            report[key] = run_case(event_engine, busy_ms / 1000)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
