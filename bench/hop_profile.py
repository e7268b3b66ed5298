"""One decode token of the split, taken apart: core's own work, and each expert hop part by part.

    python bench/hop_profile.py [--model qwen3-30b-a3b-4layer|demo|PATH] [--dtype bfloat16]
        [--tokens 128] [--workers 1] [--core-flag=--no-expert-frames]

Starts N expert workers and a core as real processes on Unix sockets (as bench/decode.py's
`workers_N`), decodes `--tokens` greedily through Core.Generate and reads core's own timers
(Core.GetStats, over the decode steps only). Per hop (one MoE layer's expert call), p50 us:

  core_sync      core's evaluation of the layer's hidden states and routes: its attention, router
                 and everything since the last hop, plus the synchronisation itself
  encode         routing, host bytes, the ExpertCall message
  send           from there to the worker starting on it (the socket write, wakeup, read, parse)
  worker_decode  checks and arrays, worker_compute  the experts with the worker's one sync,
  worker_encode  the reply message
  reply          from the worker's reply encoded to core holding it parsed
  core_decode    the reply back into one MLX array
  (send and reply need one clock: same-host frame links only)

Per token: the engine step's p50, the hops' share (MoE layers x (core_sync + the call)), and
core's overhead (the rest: the last layers and lm_head, sampling, BatchGenerator bookkeeping,
the token's stream write). `bare_expert_us` is mlx-lm's expert module alone on one token with
one evaluation per call, in this process before the services start, and `hop_overhead_p50_us`
a layer call's p50 minus it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import PROMPT, checkpoint, log, spin_as_up, split_system, timed_decode
from bench.workdir import bench_workdir
from services.common.manifest import Manifest
from services.common.model_build import expert_modules
from services.core.expert_link.links import HOP_PARTS
from services.ops.up import resolve_split


def bare_expert_us(path: Path, calls: int = 300) -> float:
    """p50 us of the first MoE layer's mlx-lm expert module on one token, evaluated per call."""
    import mlx_lm

    model, _ = mlx_lm.load(str(path))
    _, module = next(expert_modules(model))
    hidden = model.args.hidden_size
    x = mx.random.normal((1, 1, hidden)).astype(_float_dtype(module))
    k = int(getattr(model.args, "num_experts_per_tok", 8))
    experts = int(getattr(model.args, "num_experts", 8))
    times = []
    for i in range(calls + 20):
        ids = mx.array(
            np.random.default_rng(i).choice(experts, k, replace=False)[None, None].astype(np.int32)
        )
        mx.eval(x, ids)
        started = time.perf_counter()
        mx.eval(module(x, ids))
        if i >= 20:
            times.append((time.perf_counter() - started) * 1e6)
    del model
    return float(np.percentile(times, 50))


def _float_dtype(module) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(module.parameters()):
        if value.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return value.dtype
    return mx.float32


def main() -> None:
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b-4layer")
    parser.add_argument("--dtype", default="float32", help="synthetic model's dtype (bfloat16 on GPUs)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--core-flag", action="append", default=[], help="extra `moe-mesh core` flag")
    args = parser.parse_args()
    path = checkpoint(args.model, args.dtype)
    split = resolve_split(str(path))
    moe_layers = len(Manifest.load(split).layers)
    if args.model == "demo":
        import mlx_lm

        prompt = mlx_lm.load(str(path), lazy=True)[1].encode(PROMPT)
    else:
        prompt = list(range(1000, 1024))
    log("timing the bare expert module in this process")
    bare = bare_expert_us(path)
    workdir = bench_workdir("mm-hop-")
    log(f"decoding {args.tokens} tokens through core + {args.workers} worker(s)")
    with split_system(split, workdir, args.workers, spin_as_up(args.workers), args.core_flag) as (address, _):
        _, stamps, calls = timed_decode(address, prompt, args.tokens)
    token_us = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e6
    part = {name: round(calls.part_p50_us[name], 1) for name in HOP_PARTS if name in calls.part_p50_us}
    step_us = calls.part_p50_us.get("engine_step", token_us)
    hop_us = part.get("core_sync", 0.0) + calls.total_p50_us
    report = {
        "bench": "hop_profile",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "model": args.model,
        "dtype": args.dtype,
        "workers": args.workers,
        "core_flags": args.core_flag,
        "decode_tokens": args.tokens,
        "moe_layers": moe_layers,
        "per_token": {
            "wall_us": round(token_us, 1),
            "engine_step_p50_us": round(step_us, 1),
            "hops_us": round(moe_layers * hop_us, 1),
            "core_sync_us": round(moe_layers * part.get("core_sync", 0.0), 1),
            "layer_calls_us": round(moe_layers * calls.total_p50_us, 1),
            "core_overhead_us": round(step_us - moe_layers * hop_us, 1),
            "outside_engine_step_us": round(token_us - step_us, 1),
        },
        "per_hop_p50_us": {**part, "layer_call_total": round(calls.total_p50_us, 1)},
        "per_hop_p99_us": {name: round(calls.part_p99_us[name], 1) for name in part},
        "bare_expert_us": round(bare, 1),
        "hop_overhead_p50_us": round(calls.total_p50_us - bare, 1),
        "layer_calls_measured": calls.calls,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
