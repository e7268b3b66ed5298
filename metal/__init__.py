"""Kernels: TurboQuant's Metal and CUDA sources with their loader (kernels.py), and the C
extensions for CPUs (turboquant_cpu.c, experts_cpu.c), called through ctypes."""

import ctypes
import importlib.util


def load_extension(name: str) -> ctypes.CDLL | None:
    """A ctypes handle on one of this package's compiled extensions (setup.py builds them, optional:
    without a C compiler the install skips them), or None where it is not built."""
    spec = importlib.util.find_spec(f"metal.{name}")
    if spec is None or not spec.origin:
        return None
    return ctypes.CDLL(spec.origin)
