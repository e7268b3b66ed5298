"""Where a worker's expert weights come from.

`ExpertStore` is the interface the compute side uses. The compute side loads each
served layer's mlx-lm expert module once with `weights(layer)` and, per call, asks
`plan` how to split the call's experts into groups that fit in memory together and
`load` to make one group's experts present, getting back the row of each expert in
those weights. `ResidentExpertStore` keeps every owned expert in RAM (one group,
nothing to load); `StreamingExpertStore` (streaming_store.py) keeps a byte budget of
them and reads the rest from the layer files on demand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import numpy as np

from services.common.load_progress import LoadProgress
from services.common.manifest import Manifest, MoeLayer
from services.experts.io import ExpertFileError, check_layer_file

__all__ = [
    "ExpertFileError",
    "ExpertStore",
    "ResidentExpertStore",
    "StoreStats",
    "read_records",
    "records_to_weights",
]


@dataclass(frozen=True)
class StoreStats:
    resident_bytes: int
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    evictions: int = 0
    read_seconds: float = 0.0
    read_failures: int = 0
    slots: int = 0  # experts the cache can hold (0 for the resident store: it holds all)
    cached: int = 0  # experts present right now
    io_mode: str = ""
    policy: str = ""

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertStore(Protocol):
    manifest: Manifest
    owned: dict[int, list[int]]  # layer -> sorted expert ids

    def weights(self, layer: int) -> dict[str, mx.array]:
        """The stacked arrays the layer's expert module is loaded with, once, at start."""
        ...

    def plan(self, layer: int, experts: list[int]) -> list[list[int]]:
        """Split owned `experts` (unique) into groups whose weights fit in memory together."""
        ...

    def load(self, layer: int, experts: list[int]) -> np.ndarray:
        """Make one planned group present; [num_experts] int32: row in `weights(layer)`, -1 if absent.

        The rows stay valid until the next `load`. Raises ExpertFileError if a read fails.
        """
        ...

    def is_resident(self, layer: int, expert: int) -> bool: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


def read_records(split_dir: Path, layer: MoeLayer, experts: list[int]) -> np.ndarray:
    """[len(experts), record_size] uint8: the experts' records, checked against the manifest."""
    path = check_layer_file(split_dir, layer)
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
    """Every owned expert in RAM, loaded at start; every call is one group with nothing to read."""

    def __init__(self, split_dir: Path, manifest: Manifest, owned: dict[int, list[int]]):
        self.manifest = manifest
        self.owned = {layer: sorted(experts) for layer, experts in owned.items() if experts}
        self._weights: dict[int, dict[str, mx.array]] = {}
        self._rows: dict[int, np.ndarray] = {}
        progress = LoadProgress("weights_read", len(self.owned))
        for layer_index, experts in self.owned.items():
            layer = manifest.layer(layer_index)
            self._weights[layer_index] = records_to_weights(layer, read_records(split_dir, layer, experts))
            mx.eval(self._weights[layer_index])
            progress.advance(nbytes=sum(a.nbytes for a in self._weights[layer_index].values()))
            rows = np.full(layer.num_experts, -1, dtype=np.int32)
            rows[experts] = np.arange(len(experts), dtype=np.int32)
            self._rows[layer_index] = rows
        self._resident_bytes = sum(a.nbytes for w in self._weights.values() for a in w.values())

    def weights(self, layer: int) -> dict[str, mx.array]:
        return self._weights[layer]

    def plan(self, layer: int, experts: list[int]) -> list[list[int]]:
        return [list(experts)]

    def load(self, layer: int, experts: list[int]) -> np.ndarray:
        return self._rows[layer]

    def is_resident(self, layer: int, expert: int) -> bool:
        return True

    def stats(self) -> StoreStats:
        return StoreStats(resident_bytes=self._resident_bytes)

    def close(self) -> None:
        pass
