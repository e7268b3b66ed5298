"""The workers' CPU expert kernel (metal/experts_cpu.c) against MLX's CPU quantized matmul, on one
MoE layer built as mlx-lm builds it (random 4-bit weights, group 64), per call size and thread count.

    python bench/expert_kernel.py [--shape qwen3-30b-a3b|demo] [--tokens 1,64] [--threads 1,2,4,8,16]

Prints one JSON object: per call size, MLX's median µs, the kernel's median µs per thread count
(thread counts above this process's CPUs are skipped) and the largest difference from MLX's
output relative to its largest value (float32: rounding only).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import timed
from metal.experts_cpu import SwitchGLUKernel, default_threads, simd

# (hidden, moe_intermediate, experts, top-k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "demo": (576, 192, 8, 8)}


def cpu_model() -> str:
    try:
        return next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor()


def measure(module, kernel, ids: np.ndarray, hidden: int, threads: list[int]) -> dict:
    tokens, k = ids.shape
    x = mx.random.normal((tokens, hidden))
    mx.eval(x)
    host, token_of, row = np.asarray(x), np.repeat(np.arange(tokens, dtype=np.int32), k), ids.ravel()
    want = np.asarray(module(x, mx.array(ids)).reshape(-1, hidden))
    got = kernel(host, token_of, row)
    calls = max(3, 200 // tokens)
    entry = {
        "mlx_us": timed(lambda: mx.eval(module(x, mx.array(ids))), max(3, calls // 10), warmup=2)["p50_us"],
        "max_rel_diff_vs_mlx": float(np.abs(got - want).max() / np.abs(want).max()),
        "kernel_us": {n: timed(lambda n=n: kernel(host, token_of, row, n), calls)["p50_us"] for n in threads},
    }
    entry["best_speedup_vs_mlx"] = round(entry["mlx_us"] / min(entry["kernel_us"].values()), 1)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,64", help="comma-separated tokens per call")
    parser.add_argument("--threads", default="1,2,4,8,16,32")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    hidden, inter, experts, k = SHAPES[args.shape]
    mx.random.seed(0)
    module = SwitchGLU(hidden, inter, experts)
    nn.quantize(module, group_size=64, bits=4)
    mx.eval(module.parameters())
    kernel = SwitchGLUKernel.for_module(module)
    if kernel is None:
        sys.exit("the CPU expert kernel is not built here (metal._experts_cpu; see setup.py)")
    cores = default_threads()
    report = {
        "bench": "expert_kernel",
        "machine": f"{platform.system()} {platform.machine()}, {cores} CPUs, {cpu_model()}",
        "simd": simd(),
        "layer": f"{args.shape}: hidden {hidden}, {experts} experts, top-{k}, moe_intermediate {inter}, 4-bit g64",
        "calls": {},
    }
    rng = np.random.default_rng(0)
    threads = [n for n in (int(t) for t in args.threads.split(",")) if n <= cores]
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
        entry = measure(module, kernel, ids, hidden, threads)
        report["calls"][f"tokens_{tokens}"] = entry
        print(f"[bench] {tokens} tokens: {entry}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
