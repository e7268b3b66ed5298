"""The Metal backend: metal/turboquant.metal through mx.fast.metal_kernel, with the
contracts of metal/backend.py (the twin's numbers).

The kernels only exist on Apple GPUs: `present()` is False elsewhere. Core uses them only
after they reproduced the twin on a random self-check (services/core/kv/kernel_check.py,
remembered per device and build by metal/selfcheck.py): a kernel that disagrees is never
used, the twin is.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from metal.backend import KernelBackend

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


NAME = "metal"
present = metal_present


def sources() -> list[Path]:
    """The files whose bytes a remembered self-check pass is valid for."""
    return [SOURCE, Path(__file__).with_name("backend.py")]
