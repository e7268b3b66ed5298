"""Experts under a memory budget: a fixed pool of slots, filled from the layer files on demand.

Memory is allocated once, at start: for each tensor of an expert record (e.g.
`gate_proj.weight`, `.scales`, `.biases`) one MLX array of `slots` rows — a slab.
Every served layer with that record layout has its expert module loaded with the
same slabs, and a call's expert ids are mapped to slot rows. So the cache is the
compute input: a hit costs nothing, a miss is one `preadv` straight into the slot's
rows (page cache) or through an aligned staging buffer (direct I/O), and the math is
the model's own mlx-lm module, row for row the same as with every expert resident —
outputs are bit-identical.

RSS is bounded by the slabs (`slots x record bytes` <= the budget) plus the I/O
threads' staging buffers (one record each, direct I/O only) plus what the process
needs anyway; nothing grows with the number of experts served.

A call whose experts do not all fit is computed in groups (`plan`): each group is
loaded, computed and evaluated before the next one may reuse its slots. The slots
of the group being loaded are pinned; the policy picks victims among the rest.

Writing into an evaluated MLX array through the buffer protocol is safe here
because the worker evaluates every call before the next load: no computation that
reads a slab is in flight while it is written.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.common.manifest import ExpertTensor, Manifest, MoeLayer
from services.experts.cache_policy import CachePolicy, make_policy
from services.experts.io import (
    DEFAULT_IO_THREADS,
    DEFAULT_MIN_SEGMENT_BYTES,
    ExpertFileError,
    RecordRead,
    RecordReader,
)
from services.experts.store import StoreStats

PAGE = 4096


def layout_key(layer: MoeLayer) -> tuple:
    return tuple((t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in layer.tensors)


def expert_bytes(layer: MoeLayer) -> int:
    """Bytes one expert takes in memory (its tensors, without the record's padding)."""
    return sum(t.nbytes for t in layer.tensors)


class BudgetTooSmall(ValueError):
    pass


@dataclass
class SlotPool:
    """Slabs for one record layout and the bookkeeping of which expert sits in which slot."""

    tensors: list[ExpertTensor]
    slots: int
    policy: CachePolicy
    arrays: dict[str, mx.array] = field(default_factory=dict)  # what the modules compute with
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # [slots, nbytes] uint8, same memory
    slot_of: dict[Hashable, int] = field(default_factory=dict)
    key_in: list[Hashable | None] = field(default_factory=list)
    free: list[int] = field(default_factory=list)

    def allocate(self) -> None:
        for spec in self.tensors:
            self.rows[spec.name], self.arrays[spec.name] = _page_aligned_slab(self.slots, spec)
        self.key_in = [None] * self.slots
        self.free = list(range(self.slots - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _page_aligned_slab(slots: int, spec: ExpertTensor) -> tuple[np.ndarray, mx.array]:
    """([slots, nbytes] uint8 rows to write, the [slots, *shape] array to compute with), one memory.

    The slab starts on a page boundary (a view into a slightly larger allocation), so when a
    tensor's size is a multiple of the page, every slot row is page-aligned and direct I/O can
    read straight into it instead of through a staging buffer.
    """
    raw = mx.zeros((slots * spec.nbytes + PAGE,), dtype=mx.uint8)
    mx.eval(raw)
    host = np.asarray(memoryview(raw))
    start = (-host.ctypes.data) % PAGE
    storage_dtype = mx.uint16 if spec.dtype == "bfloat16" else spec.mlx_dtype
    array = raw[start : start + slots * spec.nbytes].view(storage_dtype).reshape(slots, *spec.shape)
    if spec.dtype == "bfloat16":
        array = array.view(mx.bfloat16)
    mx.eval(array)
    rows = host[start : start + slots * spec.nbytes].reshape(slots, spec.nbytes)
    if np.asarray(memoryview(array.view(mx.uint8) if spec.dtype == "bfloat16" else array)).ctypes.data != (
        rows.ctypes.data
    ):  # MLX copied instead of viewing: fall back to a plain slab (writes must reach the array)
        slab = mx.zeros((slots, *spec.shape), dtype=storage_dtype)
        mx.eval(slab)
        rows = np.asarray(memoryview(slab)).reshape(slots, -1).view(np.uint8)
        array = slab.view(mx.bfloat16) if spec.dtype == "bfloat16" else slab
        mx.eval(array)
    return rows, array


class StreamingExpertStore:
    """Owned experts under `budget_bytes`, read from the layer files on demand.

    Counters (hits, misses, evictions, bytes read, read seconds) are per expert
    access; a failed read raises ExpertFileError for that call only, leaves the
    slot empty and counts in `read_failures`.

    Not thread-safe: one caller at a time (the servicer runs calls one by one on its event
    loop); the parallelism is inside `load`, whose reads go to the reader's thread pool.
    """

    def __init__(
        self,
        split_dir: Path,
        manifest: Manifest,
        owned: dict[int, list[int]],
        budget_bytes: int,
        io_mode: str = "buffered",
        policy: str = "lru",
        io_threads: int = DEFAULT_IO_THREADS,
        min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES,
        metrics=None,
        trace_path: Path | None = None,
    ):
        self.manifest = manifest
        self.owned = {layer: sorted(experts) for layer, experts in owned.items() if experts}
        self.budget_bytes = int(budget_bytes)
        self.io_mode = io_mode
        self._metrics = metrics
        layers = [manifest.layer(index) for index in self.owned]
        self._pools: dict[tuple, SlotPool] = {}
        self._pool_of: dict[int, SlotPool] = {}
        demand: dict[tuple, int] = {}  # layout -> experts owned with it
        example: dict[tuple, MoeLayer] = {}
        for layer in layers:
            key = layout_key(layer)
            demand[key] = demand.get(key, 0) + len(self.owned[layer.layer])
            example.setdefault(key, layer)
        total_demand = sum(demand[key] * expert_bytes(example[key]) for key in demand)
        for key, count in demand.items():
            per_expert = expert_bytes(example[key])
            share = self.budget_bytes * (count * per_expert) / total_demand if total_demand else 0
            slots = min(count, int(share // per_expert))
            if slots < 1:
                raise BudgetTooSmall(
                    f"memory budget {self.budget_bytes / 1e9:.3f} GB holds no expert "
                    f"(one expert takes {per_expert / 1e6:.1f} MB); raise --memory-gb"
                )
            self._pools[key] = SlotPool(list(example[key].tensors), slots, make_policy(policy, slots))
        for layer in layers:
            self._pool_of[layer.layer] = self._pools[layout_key(layer)]
        self._reader = RecordReader(
            split_dir, layers, mode=io_mode, threads=io_threads, min_segment_bytes=min_segment_bytes
        )
        for pool in self._pools.values():
            pool.allocate()
        self.policy_name = policy
        self._hits = self._misses = self._evictions = self._bytes = self._failures = 0
        self._read_seconds = 0.0
        # bench/stream.py replays the (layer, experts) of every call to compare policies offline.
        self._trace = open(trace_path, "a", buffering=1) if trace_path else None

    # -- the ExpertStore interface -------------------------------------------------

    def weights(self, layer: int) -> dict[str, mx.array]:
        return self._pool_of[layer].arrays

    def plan(self, layer: int, experts: list[int]) -> list[list[int]]:
        pool = self._pool_of[layer]
        if self._trace is not None:
            self._trace.write(f"{layer} {' '.join(map(str, experts))}\n")
        cached = [e for e in experts if (layer, e) in pool.slot_of]
        missing = [e for e in experts if (layer, e) not in pool.slot_of]
        ordered = cached + missing  # hits first: they are computed before anything can evict them
        return [ordered[i : i + pool.slots] for i in range(0, len(ordered), pool.slots)]

    def load(self, layer: int, experts: list[int]) -> np.ndarray:
        pool = self._pool_of[layer]
        if len(experts) > pool.slots:
            raise ValueError(f"{len(experts)} experts in one group, the cache holds {pool.slots}")
        pinned = {(layer, e) for e in experts}
        reads, hits = [], 0
        for expert in experts:
            key = (layer, expert)
            if key in pool.slot_of:
                hits += 1
                pool.policy.touch(key)
                continue
            slot = self._take_slot(pool, pinned)
            reads.append(
                (
                    key,
                    slot,
                    RecordRead(layer, expert, [(t.offset, pool.rows[t.name][slot]) for t in pool.tensors]),
                )
            )
        nbytes, seconds, failures = self._reader.read_many([read for _, _, read in reads])
        failed = {(read.layer, read.expert) for read, _ in failures}
        for key, slot, _ in reads:
            if key in failed:
                pool.free.append(slot)  # its bytes are undefined: never let a call see them
            else:
                pool.slot_of[key] = slot
                pool.key_in[slot] = key
                pool.policy.touch(key)
        self._hits += hits
        self._misses += len(reads)
        self._bytes += nbytes
        self._read_seconds += seconds
        self._failures += len(failures)
        if self._metrics is not None:
            self._metrics.record(hits, len(reads), nbytes, seconds, len(failures))
        if failures:
            first = failures[0][1]
            more = f" (and {len(failures) - 1} more failed reads)" if len(failures) > 1 else ""
            raise ExpertFileError(first + more)
        rows = np.full(self.manifest.num_experts, -1, dtype=np.int32)
        for expert in experts:
            rows[expert] = pool.slot_of[(layer, expert)]
        return rows

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._pool_of[layer].slot_of

    def stats(self) -> StoreStats:
        return StoreStats(
            resident_bytes=sum(pool.nbytes for pool in self._pools.values()),
            hits=self._hits,
            misses=self._misses,
            bytes_read=self._bytes,
            evictions=self._evictions,
            read_seconds=self._read_seconds,
            read_failures=self._failures,
            slots=sum(pool.slots for pool in self._pools.values()),
            cached=sum(len(pool.slot_of) for pool in self._pools.values()),
            io_mode=self._reader.mode,  # "buffered" if the filesystem refused direct I/O
            policy=self.policy_name,
        )

    def close(self) -> None:
        self._reader.close()
        if self._trace is not None:
            self._trace.close()

    # -- internals -----------------------------------------------------------------

    def _take_slot(self, pool: SlotPool, pinned: set) -> int:
        if pool.free:
            return pool.free.pop()
        victim = pool.policy.victim(pinned)
        slot = pool.slot_of.pop(victim)
        pool.key_in[slot] = None
        pool.policy.forget(victim)
        self._evictions += 1
        if self._metrics is not None:
            self._metrics.evicted(1)
        return slot
