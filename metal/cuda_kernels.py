"""The CUDA backend: metal/turboquant.cu (the twin of turboquant.metal, section for
section) through mx.fast.cuda_kernel, with the contracts of metal/backend.py.

For MLX's CUDA backend (e.g. an H200), where it gives the same fused design as the Metal
kernels a real GPU to run on. `present()` is False unless MLX has CUDA; core uses the
kernels only after they reproduced the twin on a random self-check
(services/core/kv/kernel_check.py): a kernel that fails to compile or disagrees is never used.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from metal.backend import KernelBackend

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


NAME = "cuda"
present = cuda_present


def sources() -> list[Path]:
    """The files whose bytes a remembered self-check pass is valid for."""
    return [SOURCE, Path(__file__).with_name("backend.py")]
