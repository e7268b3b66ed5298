"""The fused-kernel backend for this device: the first module of BACKENDS (metal/) that is
present and passed its self-check against the twin (kernel_check.py), or None, in which
case the pure-MLX twin serves.

A backend is a module with NAME, present(), sources() and `decode_attention(queries, cache,
scale, start)` (the whole decode step fused; None where it does not fit) and/or
`key_scores(codec, rotated_queries, tokens)` with `weighted_values(codec, weights, tokens)`
(the contracts of metal/backend.py), and optionally `pack(codec, x)` (encode) and
`decoded_run`. A backend that evaluates its inputs (the CPU one calls C on host memory)
says so with `EVALUATES_INPUTS = True`.
"""

from __future__ import annotations

import importlib
import threading
from functools import cache

from services.core.kv import kernel_slot
from services.core.kv.kernel_check import kernels_pass

# modules tried in order; the first that passes serves
BACKENDS = ("metal.kernels", "metal.cuda_kernels", "metal.cpu_kernels")

_selecting = threading.local()


def kernel_backend():
    """The fused-kernel module for this device, or None (the pure-MLX twin serves).

    Chosen once per process. While a backend's self-check runs, the caches it builds see
    None (the twin), so the check compares kernels with the twin and never recurses into
    another self-check."""
    if getattr(_selecting, "active", False):
        return None
    return _select_backend()


@cache
def _select_backend():
    _selecting.active = True
    try:
        for name in BACKENDS:
            try:
                module = importlib.import_module(name)
            except ImportError:  # metal/ not installed with the package, or not built
                continue
            if kernels_pass(module):
                return module
        return None
    finally:
        _selecting.active = False


def kernels_ready() -> bool:
    return kernel_backend() is not None


def _chosen():
    return kernel_backend()  # the name is looked up on each call: tests may replace it


kernel_slot.register(_chosen)
