"""The Metal backend: metal/turboquant.metal through mx.fast.metal_kernel, with the
contracts of metal/backend.py (the twin's numbers).

The kernels only exist on Apple GPUs. `kernels_available()` is False elsewhere, and on a
Mac it is True only after the kernels reproduced the twin on a random self-check (run
once per process, metal/selfcheck.py): a kernel that disagrees is never used, the twin is.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx

from metal.backend import KernelBackend
from metal.selfcheck import backend_matches_twin, passes_once_per_build

SOURCE = Path(__file__).with_name("turboquant.metal")
# Apple GPUs give a threadgroup 32 KiB of memory
_BACKEND = KernelBackend(SOURCE, mx.fast.metal_kernel, shared_limit=32 * 1024)

pack = _BACKEND.pack
key_scores = _BACKEND.key_scores
weighted_values = _BACKEND.weighted_values
decode_attention = _BACKEND.decode_attention
decoded_run = _BACKEND.decoded_run


def _sections() -> dict[str, str]:
    return _BACKEND.sections()


def metal_present() -> bool:
    return mx.metal.is_available()


def kernels_match_twin(seed: int = 0, failures: list[str] | None = None) -> bool:
    """Run every kernel on random data and compare with the pure-MLX twin (what disagreed
    goes to `failures`)."""
    return backend_matches_twin(_BACKEND, seed, failures)


@cache
def kernels_available() -> bool:
    """True on an Apple GPU whose kernels match the twin on a random self-check (once per
    device and kernel build: metal/selfcheck.py)."""
    if not metal_present():
        return False
    try:
        return passes_once_per_build(
            "metal", [SOURCE, Path(__file__).with_name("backend.py")], kernels_match_twin
        )
    except Exception:  # noqa: BLE001 - any kernel failure means: use the twin
        return False
