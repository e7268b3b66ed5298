"""What two processes pay for taking turns on one GPU, against one process doing the same work.

    python bench/gpu_turns.py --turns 2000

A turn is one small kernel chain (a [rows, hidden] x [hidden, inner] matmul and back, evaluated),
the shape of one token's expert work. `one_process`: one process runs two turns back to back,
as core and the experts in one process (`local_experts`) would. `two_processes`: two processes
each run one turn and hand over through a Unix socket pair (one byte), as core and a worker
process on the same GPU do at every layer call. `socket_only`: the same hand-over with no GPU
work. Reports p50 µs per pair of turns. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import socket
import time

import numpy as np


def _work(rows: int, hidden: int, inner: int):
    import mlx.core as mx

    x = mx.random.normal((rows, hidden)).astype(mx.bfloat16)
    up = (mx.random.normal((hidden, inner)) * 0.02).astype(mx.bfloat16)
    down = (mx.random.normal((inner, hidden)) * 0.02).astype(mx.bfloat16)
    mx.eval(x, up, down)

    def turn(gpu: bool) -> None:
        if gpu:
            mx.eval((x @ up) @ down)

    return turn


def _partner(sock: socket.socket, args, gpu: bool) -> None:
    turn = _work(args.rows, args.hidden, args.inner)
    while sock.recv(1) == b"t":
        turn(gpu)
        sock.sendall(b"d")


def _pairs(args, gpu: bool) -> list[float]:
    """Per pair: this process's turn, then the partner's, through the socket."""
    mine, theirs = socket.socketpair()
    partner = multiprocessing.get_context("spawn").Process(target=_partner, args=(theirs, args, gpu))
    partner.start()
    turn = _work(args.rows, args.hidden, args.inner)
    times = []
    for _ in range(args.turns + args.warmup):
        started = time.perf_counter()
        turn(gpu)
        mine.sendall(b"t")
        mine.recv(1)
        times.append(time.perf_counter() - started)
    mine.sendall(b"q")
    partner.join()
    return times[args.warmup :]


def _one_process(args) -> list[float]:
    turn = _work(args.rows, args.hidden, args.inner)
    times = []
    for _ in range(args.turns + args.warmup):
        started = time.perf_counter()
        turn(True)
        turn(True)
        times.append(time.perf_counter() - started)
    return times[args.warmup :]


def p50_us(times: list[float]) -> float:
    return round(float(np.percentile(times, 50)) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=6144)
    args = parser.parse_args()
    import mlx.core as mx

    result = {
        "bench": "gpu_turns",
        "machine": platform.node(),
        "device": str(mx.default_device()),
        "shape": {"rows": args.rows, "hidden": args.hidden, "inner": args.inner},
        "turns": args.turns,
        "p50_us_per_pair": {
            "one_process": p50_us(_one_process(args)),
            "two_processes": p50_us(_pairs(args, gpu=True)),
            "socket_only": p50_us(_pairs(args, gpu=False)),
        },
    }
    pair = result["p50_us_per_pair"]
    result["turn_taking_cost_us"] = round(
        pair["two_processes"] - pair["one_process"] - pair["socket_only"], 1
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
