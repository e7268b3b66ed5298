"""The CUDA backend: metal/turboquant.cu (the twin of turboquant.metal, section for
section) through mx.fast.cuda_kernel, with the contracts of metal/backend.py.

For MLX's CUDA backend (e.g. an H200), where it gives the same fused design as the Metal
kernels a real GPU to run on. `kernels_available()` is False unless MLX has CUDA and the
kernels reproduced the twin on a random self-check (once per process,
metal/selfcheck.py); a kernel that fails to compile or disagrees is never used.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx

from metal.backend import KernelBackend
from metal.selfcheck import backend_matches_twin, passes_once_per_build

SOURCE = Path(__file__).with_name("turboquant.cu")
# static __shared__ arrays are capped at 48 KiB per block
_BACKEND = KernelBackend(SOURCE, mx.fast.cuda_kernel, shared_limit=48 * 1024)

pack = _BACKEND.pack
key_scores = _BACKEND.key_scores
weighted_values = _BACKEND.weighted_values
decode_attention = _BACKEND.decode_attention
decoded_run = _BACKEND.decoded_run


def sections() -> dict[str, str]:
    return _BACKEND.sections()


def cuda_present() -> bool:
    return mx.cuda.is_available()


def kernels_match_twin(seed: int = 0, failures: list[str] | None = None) -> bool:
    """Run every kernel on random data and compare with the pure-MLX twin (what disagreed
    goes to `failures`)."""
    return backend_matches_twin(_BACKEND, seed, failures)


@cache
def kernels_available() -> bool:
    """True under MLX's CUDA backend when the kernels match the twin on a random self-check
    (once per device and kernel build: metal/selfcheck.py)."""
    if not cuda_present():
        return False
    try:
        return passes_once_per_build(
            "cuda", [SOURCE, Path(__file__).with_name("backend.py")], kernels_match_twin
        )
    except Exception:  # noqa: BLE001 - any kernel failure means: use the twin
        return False
