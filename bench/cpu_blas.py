"""What MLX's CPU matmuls get from the BLAS its wheel links, next to numpy's, on this machine.

    python bench/cpu_blas.py

On Linux the `mlx[cpu]` wheel bundles the reference (netlib) BLAS, so an fp32 matmul runs a plain
loop, and MLX's quantized matmul on the CPU is a scalar loop of its own: the core's attention and
lm_head on a Linux CPU run at a few GFLOPS whatever the cores can do. Prints one JSON object: GFLOPS
of one fp32 matmul through MLX and through numpy (OpenBLAS in numpy's wheel), the BLAS library MLX
loads, and one 64-token forward of the demo model's dense twin with its 4-bit weights and with
them dequantized to float32 (both through MLX).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(64, 576, 1536), (1024, 1024, 1024)]


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def matmul_gflops(m: int, k: int, n: int) -> dict:
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b)
    a_np, b_np = np.array(a), np.array(b)
    flops = 2 * m * k * n
    return {
        "shape": [m, k, n],
        "mlx_gflops": round(flops / best_seconds(lambda: mx.eval(a @ b)) / 1e9, 1),
        "numpy_gflops": round(flops / best_seconds(lambda: a_np @ b_np) / 1e9, 1),
    }


def blas_libraries() -> list[str]:
    library = Path(mx.__file__).parent / "lib" / "libmlx.so"
    if not library.exists():
        return []
    lines = subprocess.run(
        ["ldd", str(library)], check=False, capture_output=True, text=True
    ).stdout.splitlines()
    return [line.split()[0] for line in lines if "blas" in line.lower() or "accelerate" in line.lower()]


def demo_forward_ms() -> dict:
    from services.tools.kv_quality import load_bench_model

    model, _, _ = load_bench_model()
    tokens = mx.array([list(range(100, 164))])

    def forward() -> None:
        mx.eval(model.model(tokens))  # no cache, no lm_head: the layers' own matmuls

    out = {"four_bit_ms": round(1e3 * best_seconds(forward, 2))}
    modules = dict(model.named_modules())
    for path, module in list(modules.items()):
        if isinstance(module, nn.QuantizedLinear):
            weight = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits
            )
            dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            dense.weight = weight.astype(mx.float32)
            parent_path, _, name = path.rpartition(".")
            parent = modules[parent_path] if parent_path else model
            if name.isdigit():
                parent[int(name)] = dense
            else:
                setattr(parent, name, dense)
    out["float32_ms"] = round(1e3 * best_seconds(forward, 2))
    return out


def main() -> None:
    result = {
        "bench": "cpu_blas",
        "machine": f"{platform.system()} {platform.machine()}, mlx {mx.__version__} on {mx.default_device()}",
        "mlx_blas": blas_libraries(),
        "matmul": [matmul_gflops(*shape) for shape in SHAPES],
        "demo_dense_64_tokens": demo_forward_ms(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
