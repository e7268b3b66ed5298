"""Where a worker's expert weights come from.

`ExpertStore` is the interface the compute side uses; `ResidentExpertStore` keeps
every owned expert in RAM as MLX arrays (read once from the layer files at start).
The streaming store (NVMe reads under a memory budget) implements the same
interface.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import numpy as np

from services.common.manifest import Manifest, MoeLayer


class ExpertFileError(RuntimeError):
    """A layer file is missing, truncated or unreadable (names file and expert)."""


@dataclass(frozen=True)
class StoreStats:
    resident_bytes: int
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0


class ExpertStore(Protocol):
    manifest: Manifest
    owned: dict[int, list[int]]  # layer -> sorted expert ids

    def weights(self, layer: int) -> dict[str, mx.array]:
        """Stacked weights of the layer's owned experts, in `owned[layer]` order."""
        ...

    def is_resident(self, layer: int, expert: int) -> bool: ...

    def stats(self) -> StoreStats: ...


def read_records(split_dir: Path, layer: MoeLayer, experts: list[int]) -> np.ndarray:
    """[len(experts), record_size] uint8: the experts' records, checked against the manifest."""
    path = Path(split_dir) / layer.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ExpertFileError(f"{path}: missing (layer {layer.layer})") from None
    if size != layer.file_size:
        raise ExpertFileError(
            f"{path}: {size} bytes, manifest says {layer.file_size} "
            f"({layer.num_experts} experts x {layer.record_size}); the file is truncated or from another split"
        )
    out = np.empty((len(experts), layer.record_size), dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        for row, expert in enumerate(experts):
            got = os.preadv(fd, [out[row]], expert * layer.record_size)
            if got != layer.record_size:
                raise ExpertFileError(
                    f"{path}: short read of expert {expert} ({got} of {layer.record_size} bytes)"
                )
    finally:
        os.close(fd)
    return out


def records_to_weights(layer: MoeLayer, records: np.ndarray) -> dict[str, mx.array]:
    """Slice each tensor out of the records and stack it over experts as an MLX array."""
    weights = {}
    count = records.shape[0]
    for spec in layer.tensors:
        raw = np.ascontiguousarray(records[:, spec.offset : spec.offset + spec.nbytes])
        host = raw.view(spec.numpy_dtype).reshape(count, *spec.shape)
        array = mx.array(host)
        if spec.dtype == "bfloat16":
            array = array.view(mx.bfloat16)
        weights[spec.name] = array
    return weights


class ResidentExpertStore:
    """Every owned expert in RAM, loaded at start."""

    def __init__(self, split_dir: Path, manifest: Manifest, owned: dict[int, list[int]]):
        self.manifest = manifest
        self.owned = {layer: sorted(experts) for layer, experts in owned.items() if experts}
        self._weights: dict[int, dict[str, mx.array]] = {}
        for layer_index, experts in self.owned.items():
            layer = manifest.layer(layer_index)
            self._weights[layer_index] = records_to_weights(layer, read_records(split_dir, layer, experts))
            mx.eval(self._weights[layer_index])
        self._resident_bytes = sum(a.nbytes for w in self._weights.values() for a in w.values())

    def weights(self, layer: int) -> dict[str, mx.array]:
        return self._weights[layer]

    def is_resident(self, layer: int, expert: int) -> bool:
        return True

    def stats(self) -> StoreStats:
        return StoreStats(resident_bytes=self._resident_bytes)
