"""Remembering a kernel backend's self-check per device and kernel build.

The check itself (kernels against the pure-MLX twin) belongs to whoever owns the twin
(services/core/kv/kernel_check.py) and is handed in; this module only decides whether a
pass kept from an earlier process still holds. A pass is valid for one backend, device,
MLX version and the exact bytes of the files the caller names (kernel sources, built
libraries, the twin and the check).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx

CACHE_ENV = "MOE_MESH_SELFCHECK_CACHE"  # "0": check in every process


def check_key(backend: str, sources: Iterable[Path]) -> str:
    """What a remembered pass is valid for: the backend, this device, MLX's version, and the
    bytes of `sources` (and of this module)."""
    digest = hashlib.sha256(f"{backend}|{mx.__version__}|{mx.default_device()}".encode())
    info = mx.device_info()  # only what names the device: other fields (free memory) vary
    digest.update(json.dumps([info.get("device_name"), info.get("architecture")], default=str).encode())
    for path in (*sources, Path(__file__)):
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"(absent)")
    return digest.hexdigest()[:32]


def passes_once_per_build(backend: str, sources: Iterable[Path], check: Callable[[], bool]) -> bool:
    """`check()`, remembered per device and kernel build: the first process on a device runs
    it (NVRTC compiles, tens of seconds under CUDA) and leaves a file in
    $MOE_MESH_CACHE/selfcheck/; later ones with the same key skip it. Only a pass is kept, so
    a failure (or a crash in the check) is checked again by the next process."""
    cache_dir = Path(os.environ.get("MOE_MESH_CACHE", Path.home() / ".cache" / "moe-mesh")) / "selfcheck"
    use_cache = os.environ.get(CACHE_ENV, "1") != "0"
    marker = cache_dir / f"{backend}-{check_key(backend, sources)}.passed"
    if use_cache and marker.exists():
        return True
    passed = check()
    if passed and use_cache:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{mx.__version__} {mx.default_device()}\n")
        except OSError:  # a read-only cache only costs the next process its check
            pass
    return passed
