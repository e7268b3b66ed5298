"""The floor under any transport on this machine: a raw Unix-socket round trip, no gRPC.

    python bench/socket_floor.py [--payload-kb 20] [--busy-ms 0 2.5]

A server process (asyncio on uvloop, length-prefixed frames, what a minimal non-gRPC data
path would be) echoes a one-token decode payload; before answering it stays busy for
`--busy-ms` the way an MLX worker does (on the CPU, GIL released). The client blocks on the
socket like core's engine thread would. Reported: p50/p99 of the round trip minus the busy
time. With the server idle this is the socket's own cost; after a compute it adds the time
the blocked client takes to wake up, which no wire can avoid (bench/grpc_echo.py measures the
same two cases through gRPC). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import socket
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpc_echo import _busy
from bench.workdir import bench_workdir

CALLS = 2000
_HEADER = struct.Struct("<I")


def _serve(path: str, busy_s: float) -> None:
    import uvloop

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                body = await reader.readexactly(size)
                _busy(busy_s)
                writer.write(_HEADER.pack(size) + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        await asyncio.start_unix_server(answer, path)
        await asyncio.Event().wait()

    uvloop.run(main())


def measure(payload_bytes: int, busy_s: float) -> dict:
    path = str(bench_workdir("mm-floor-") / "echo.sock")
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(path, busy_s), daemon=True)
    server.start()
    try:
        for _ in range(500):
            if os.path.exists(path):
                break
            time.sleep(0.01)
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        frame = _HEADER.pack(payload_bytes) + bytes(payload_bytes)
        reply = bytearray(len(frame))
        overheads = []
        for _ in range(CALLS):
            started = time.perf_counter()
            client.sendall(frame)
            view, got = memoryview(reply), 0
            while got < len(reply):
                got += client.recv_into(view[got:])
            overheads.append((time.perf_counter() - started - busy_s) * 1e6)
        client.close()
    finally:
        server.kill()
    overheads.sort()
    return {
        "busy_ms": round(busy_s * 1e3, 3),
        "p50_us": round(overheads[len(overheads) // 2], 1),
        "p99_us": round(overheads[int(len(overheads) * 0.99)], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload-kb", type=float, default=20.0, help="~ [8, 576] float32 each way")
    parser.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 2.5])
    args = parser.parse_args()
    payload = int(args.payload_kb * 1024)
    rows = []
    for busy_ms in args.busy_ms:
        rows.append(measure(payload, busy_ms / 1e3))
        print(json.dumps({"progress": rows[-1]}), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "bench": "socket_floor",
                "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
                "payload_bytes": payload,
                "calls": CALLS,
                "rows": rows,
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
