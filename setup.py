"""The one compiled piece of moe-mesh: TurboQuant's CPU decode-attention kernels
(metal/turboquant_cpu.c). Everything else is declared in pyproject.toml.

The extension is optional: where no C compiler is found the install still succeeds and
the KV cache uses the pure-MLX twin (same numbers, slower on CPUs)."""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-fno-math-errno", "-std=c11"]

setup(
    ext_modules=[
        Extension(
            "metal._turboquant_cpu",
            sources=["metal/turboquant_cpu.c"],
            extra_compile_args=flags,
            optional=True,
        )
    ]
)
