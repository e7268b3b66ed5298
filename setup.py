"""The compiled pieces of moe-mesh: TurboQuant's CPU decode-attention kernels
(metal/turboquant_cpu.c) and the CPU kernel for quantized routed experts and core's quantized
projections (metal/experts_cpu.c).
Everything else is declared in pyproject.toml.

Both extensions are optional: where no C compiler is found the install still succeeds, the
KV cache uses the pure-MLX twin (same numbers, slower on CPUs), expert workers compute
with mlx-lm's own expert modules and core with MLX's quantized matmul."""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-fno-math-errno", "-std=c11"]


def cpu_kernel(name: str) -> Extension:
    return Extension(
        f"metal._{name}",
        sources=[f"metal/{name}.c"],
        depends=["metal/half_float.h"],
        extra_compile_args=flags,
        optional=True,
    )


setup(ext_modules=[cpu_kernel("turboquant_cpu"), cpu_kernel("experts_cpu")])
