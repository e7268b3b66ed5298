"""The expert hop inside the graph, on MLX's own distributed engine: what one layer's exchange costs.

    python bench/collective_hop.py [--backend ring] [--layers 8] [--hidden 2048] [--tokens 1]
        [--top-k 8] [--experts 128] [--dtype float32] [--steps 50]

Two processes on this host: rank 0 plays core, rank 1 a worker that holds every expert. They
decode `--steps` steps of a stand-in model: per layer, core computes its part (a projection and
a router), hands the hidden states and expert ids to the worker and takes back [T, k, H]; the
worker computes those rows (each expert scales the state: cheap on purpose, this measures the
exchange). Each side evaluates once per step: core the whole step, the worker after a one-number
header says how many tokens come. Reported, p50 over the steps: the step with exchanges, the same
step computed in one process, and their difference per layer (`exchange_us_per_layer`); and
whether the two give the same numbers (`equal`).

The exchange is two `all_sum`s over the two ranks. Core's states and ids go out packed as uint32
bits, to which the worker adds zeros (exact); the worker's rows come back, to which core adds
zeros. With several workers the second sum would gather each worker's share of the pairs.

Collectives run in the order the graph's dependencies force, not in program order, so every
exchange takes its input through `mx.depends` on the previous exchange's output. A collective
without one (an `all_sum` of `zeros_like(x)`, which keeps x's shape but not x) can be scheduled
first and pair with the wrong collective on the other rank: the ranks then deadlock or mix layers.

`--backend ring` (TCP, loopback here) runs anywhere; `--backend nccl` needs two GPUs (rank r sees
GPU r) and `jaccl` two Macs joined by Thunderbolt 5 RDMA, with MLX's environment for them set
as `mlx.launch` sets it. Prints one JSON object (rank 0's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Start both ranks, wait for them, print rank 0's report."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from services.ops.up import data_plane_envs  # the group as `moe-mesh up --distributed` forms it

    with tempfile.TemporaryDirectory() as tmp:
        envs = data_plane_envs(Path(tmp), args.backend, 2)
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__, *argv],
                env={**os.environ, **envs[rank]},
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in (1, 0)
        ]
        worker, core = ranks
        out, _ = core.communicate(timeout=600)
        worker.wait(timeout=60)
        if core.returncode or worker.returncode:
            sys.exit(f"a rank failed (core {core.returncode}, worker {worker.returncode})")
        print(out, end="")


class StandIn:
    """The same random weights on both ranks: core's projection and router per layer, and the
    worker's per-expert scales."""

    def __init__(self, args: argparse.Namespace):
        import mlx.core as mx

        self.mx, self.args = mx, args
        self.dtype = getattr(mx, args.dtype)
        mx.random.seed(0)
        h, e = args.hidden, args.experts
        self.projections = [
            (mx.random.normal((h, h)) / h**0.5).astype(self.dtype) for _ in range(args.layers)
        ]
        self.routers = [mx.random.normal((h, e)).astype(self.dtype) for _ in range(args.layers)]
        self.scales = [(1 + 0.1 * mx.random.normal((e, h))).astype(self.dtype) for _ in range(args.layers)]
        mx.eval(self.projections, self.routers, self.scales)

    def core_part(self, layer: int, h):
        """(the layer's states, its top-k expert ids [T, k] int32)"""
        mx = self.mx
        a = mx.tanh(h @ self.projections[layer])
        logits = a @ self.routers[layer]
        k = self.args.top_k
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        return a, ids

    def expert_rows(self, layer: int, a, ids):
        return a[:, None, :] * self.scales[layer][ids]

    def combine(self, a, rows):
        return a + rows.sum(axis=1).astype(a.dtype)


def core_rank(args: argparse.Namespace, model: StandIn) -> dict:
    mx = model.mx
    t, h, k = args.tokens, args.hidden, args.top_k
    x = mx.random.normal((t, h)).astype(model.dtype)

    def distributed_step():
        header = mx.distributed.all_sum(mx.array([t], dtype=mx.int32))
        state, last = mx.depends(x, header), header
        for layer in range(args.layers):
            a, ids = model.core_part(layer, state)
            packed = mx.concatenate([a.reshape(-1).view(mx.uint32), ids.reshape(-1).view(mx.uint32)])
            sent = mx.distributed.all_sum(mx.depends(packed, last))
            rows = mx.distributed.all_sum(mx.depends(mx.zeros((t, k, h), dtype=model.dtype), sent))
            state, last = model.combine(a, rows), rows
        return state

    def local_step():
        state = x
        for layer in range(args.layers):
            a, ids = model.core_part(layer, state)
            state = model.combine(a, model.expert_rows(layer, a, ids))
        return state

    def p50_ms(step) -> tuple[float, object]:
        times, out = [], None
        for i in range(args.steps + 3):
            started = time.perf_counter()
            out = step()
            mx.eval(out)
            if i >= 3:  # warm-up: kernels and connections
                times.append(time.perf_counter() - started)
        return 1e3 * float(np.median(times)), out

    local_ms, local_out = p50_ms(local_step)
    exchanged_ms, exchanged_out = p50_ms(distributed_step)
    mx.eval(mx.distributed.all_sum(mx.array([0], dtype=mx.int32)))  # header 0: the worker stops
    return {
        "bench": "collective_hop",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "backend": args.backend,
        "layers": args.layers,
        "hidden": h,
        "tokens": t,
        "top_k": k,
        "dtype": args.dtype,
        "steps": args.steps,
        "local_step_ms": round(local_ms, 3),
        "exchanged_step_ms": round(exchanged_ms, 3),
        "exchange_us_per_layer": round(1e3 * (exchanged_ms - local_ms) / args.layers, 1),
        "equal": bool(mx.array_equal(local_out, exchanged_out).item()),
    }


def worker_rank(args: argparse.Namespace, model: StandIn) -> None:
    mx = model.mx
    h, k = args.hidden, args.top_k
    width = 4 // model.dtype.size  # states per uint32
    while True:
        tokens = mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32)).item()
        if tokens == 0:
            return
        state_words, id_words = tokens * h // width, tokens * k
        last = None
        for layer in range(args.layers):
            zeros = mx.zeros((state_words + id_words,), dtype=mx.uint32)
            got = mx.distributed.all_sum(zeros if last is None else mx.depends(zeros, last))
            a = got[:state_words].view(model.dtype).reshape(tokens, h)
            ids = got[state_words:].view(mx.int32).reshape(tokens, k)
            last = mx.distributed.all_sum(model.expert_rows(layer, a, ids))
        mx.eval(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ring", choices=("ring", "nccl", "jaccl"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if "MLX_RANK" not in os.environ:
        launch(args, sys.argv[1:])
        return
    import mlx.core as mx

    group = mx.distributed.init(backend=args.backend, strict=True)
    model = StandIn(args)
    if group.rank() == 0:
        print(json.dumps(core_rank(args, model), indent=1))
    else:
        worker_rank(args, model)


if __name__ == "__main__":
    main()
