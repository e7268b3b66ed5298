"""The floor under every layer call: an ExpertWorker.Forward round trip that does no math.

    python bench/grpc_echo.py [--hidden 576] [--top-k 8]

Measures, in fresh processes each, the p50/p99 of one ExpertCall/ExpertResult round trip on a Unix
socket, client side as core does it (streams on an I/O thread running uvloop, hand-off through a
queue), with one-token decode payloads (hidden [1, H] float32 out, [k, H] float32 back): with
gRPC's EventEngine client/listener on (grpcio's default) and off (what moe-mesh sets), and with the
server busy 0 or 2.5 ms per call before answering (wake-up latency after a compute). The server
stays busy the way an MLX worker does: on the CPU, with the GIL released. Prints one JSON object.

`bench/layer_call.py` uses `start_echo_server` and `EchoLink` to measure this floor next to the real
layer call, with the server busy for as long as the worker's experts take.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

CALLS = 2000
_HERE = Path(__file__).resolve()


def _busy(seconds: float, block: bytes = bytes(8192)) -> None:
    """Occupy a core for `seconds` with the GIL released, as an MLX eval does."""
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        hashlib.sha256(block).digest()  # hashlib drops the GIL for large inputs


def serve(address: str, busy_s: float) -> None:
    import grpc
    import uvloop

    from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc

    class Echo(expert_pb2_grpc.ExpertWorkerServicer):
        async def Forward(self, request_iterator, context):
            async for call in request_iterator:
                _busy(busy_s)
                # As many bytes back as a worker sends: one row per (token, expert) pair.
                rows, k = call.expert_ids.shape if call.expert_ids.shape else (0, 0)
                result = expert_pb2.ExpertResult(call_id=call.call_id)
                result.output.dtype = call.hidden.dtype
                result.output.shape[:] = [rows * k, call.hidden.shape[1] if call.hidden.shape else 0]
                result.output.data = call.hidden.data * k
                yield result

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        expert_pb2_grpc.add_ExpertWorkerServicer_to_server(Echo(), server)
        server.add_insecure_port(address)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


def start_echo_server(address: str, busy_s: float, env: dict | None = None) -> subprocess.Popen:
    """An echo ExpertWorker in its own process, ready when this returns; kill() it when done."""
    server = subprocess.Popen(
        [sys.executable, str(_HERE), "serve", address, str(busy_s)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=_HERE.parents[1],
    )
    server.stdout.readline()
    return server


class EchoLink:
    """One Forward stream driven the way ExpertDispatcher drives its links: the stream lives on
    a uvloop I/O thread (`loop`, or a new one), a call is handed over with call_soon_threadsafe
    and the reply comes back through a SimpleQueue."""

    def __init__(self, address: str, hidden_size: int, k: int, loop: asyncio.AbstractEventLoop | None = None):
        import grpc
        import numpy as np

        from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc

        if loop is None:
            import uvloop

            loop = uvloop.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True).start()
        self.loop = loop
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._call = expert_pb2.ExpertCall(call_id=1, layer=0)
        self._call.hidden.dtype, self._call.expert_ids.dtype = 1, 4  # FLOAT32, INT32
        self._call.hidden.shape[:] = [1, hidden_size]
        self._call.hidden.data = np.zeros((1, hidden_size), np.float32).tobytes()
        self._call.expert_ids.shape[:] = [1, k]
        self._call.expert_ids.data = np.arange(k, dtype=np.int32).tobytes()

        async def open_stream():
            self._channel = grpc.aio.insecure_channel(address)
            return expert_pb2_grpc.ExpertWorkerStub(self._channel).Forward()

        self._stream = asyncio.run_coroutine_threadsafe(open_stream(), loop).result()

    async def _one(self) -> None:
        await self._stream.write(self._call)
        self._replies.put(await self._stream.read())

    def round_trip(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.create_task, self._one())
        self._replies.get()

    def close(self) -> None:
        async def close():
            self._stream.cancel()
            await self._channel.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)


def client(address: str, busy_s: float, hidden_size: int, k: int) -> dict:
    import numpy as np

    link = EchoLink(address, hidden_size, k)
    for _ in range(100):
        link.round_trip()
    samples = []
    for _ in range(CALLS if busy_s == 0 else CALLS // 4):
        started = time.perf_counter()
        link.round_trip()
        samples.append((time.perf_counter() - started - busy_s) * 1e6)
    p50, p99 = np.percentile(samples, [50, 99])
    return {"p50_us": round(float(p50), 1), "p99_us": round(float(p99), 1)}


def run_case(event_engine: bool, busy_s: float, hidden_size: int, k: int) -> dict:
    address = f"unix:/tmp/mm-echo-{os.getpid()}.sock"
    env = {
        **os.environ,
        "GRPC_EXPERIMENTS": "" if event_engine else "-event_engine_client,-event_engine_listener",
    }
    server = start_echo_server(address, busy_s, env)
    try:
        out = subprocess.run(
            [sys.executable, str(_HERE), "client", address, str(busy_s), str(hidden_size), str(k)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)
    finally:
        server.kill()
        server.wait()


def main() -> None:
    sys.path.insert(0, str(_HERE.parents[1]))
    if len(sys.argv) > 1 and sys.argv[1] in ("serve", "client"):
        address, busy_s = sys.argv[2], float(sys.argv[3])
        if sys.argv[1] == "serve":
            serve(address, busy_s)
        else:
            print(json.dumps(client(address, busy_s, int(sys.argv[4]), int(sys.argv[5]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (the demo model's: 576)")
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    report = {
        "bench": "grpc_echo",
        "note": "round trip minus the server's busy time, microseconds",
        "payload": {"hidden": [1, args.hidden], "output": [args.top_k, args.hidden], "dtype": "float32"},
    }
    for event_engine in (True, False):
        for busy_ms in (0.0, 2.5):
            key = f"event_engine_{'on' if event_engine else 'off'}_busy_{busy_ms}ms"
            report[key] = run_case(event_engine, busy_ms / 1000, args.hidden, args.top_k)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
