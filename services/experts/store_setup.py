"""Pick a worker's expert store from its flags, and report the store in Describe."""

from __future__ import annotations

import os
from pathlib import Path

from services.common.logging import get_logger
from services.common.manifest import Manifest
from services.experts.cache_policy import POLICIES
from services.experts.io import DEFAULT_IO_THREADS, DEFAULT_MIN_SEGMENT_BYTES, IO_MODES
from services.experts.metrics import ExpertCacheMetrics
from services.experts.store import ExpertStore, ResidentExpertStore, StoreStats
from services.experts.streaming_store import StreamingExpertStore, expert_bytes
from services.proto.moemesh.v1 import expert_pb2

log = get_logger(__name__)

# Direct I/O streams faster than a cold page cache and leaves no second copy of streamed experts
# in it; lfu-decay ties LRU on uniform routing and wins on skewed routing (bench/stream.py; the
# figures are in docs/benchmarks.md, "Expert streaming").
DEFAULT_IO_MODE = "direct"
DEFAULT_POLICY = "lfu-decay"
TRACE_ENV = "MOE_MESH_EXPERT_TRACE"  # a file: one line per call, "layer expert expert ..." (benchmarks)


def shard_bytes(manifest: Manifest, owned: dict[int, list[int]]) -> int:
    """Bytes the owned experts take in memory."""
    return sum(expert_bytes(manifest.layer(layer)) * len(experts) for layer, experts in owned.items())


def open_store(
    split_dir: Path,
    manifest: Manifest,
    owned: dict[int, list[int]],
    memory_gb: float | None = None,
    io_mode: str = DEFAULT_IO_MODE,
    policy: str = DEFAULT_POLICY,
    io_threads: int = DEFAULT_IO_THREADS,
    min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES,
) -> tuple[ExpertStore, int]:
    """(store, budget bytes; 0 = unbounded). A budget that holds the whole shard loads it all."""
    if io_mode not in IO_MODES:
        raise ValueError(f"--io {io_mode!r}: choose one of {', '.join(IO_MODES)}")
    if policy not in POLICIES:
        raise ValueError(f"--cache-policy {policy!r}: choose one of {', '.join(POLICIES)}")
    metrics = ExpertCacheMetrics.for_registry()
    needed = shard_bytes(manifest, owned)
    if memory_gb is not None and memory_gb <= 0:
        raise ValueError(f"--memory-gb must be positive, got {memory_gb}")
    budget = 0 if memory_gb is None else int(memory_gb * 1e9)
    if budget == 0 or budget >= needed:
        if budget:
            log.info("expert_budget_holds_shard", budget_bytes=budget, shard_bytes=needed)
        store: ExpertStore = ResidentExpertStore(split_dir, manifest, owned)
    else:
        store = StreamingExpertStore(
            split_dir,
            manifest,
            owned,
            budget,
            io_mode=io_mode,
            policy=policy,
            io_threads=io_threads,
            min_segment_bytes=min_segment_bytes,
            metrics=metrics,
            trace_path=os.environ.get(TRACE_ENV) or None,
        )
        log.info(
            "expert_streaming",
            budget_bytes=budget,
            shard_bytes=needed,
            slots=store.stats().slots,
            io=io_mode,
            policy=policy,
            io_threads=io_threads,
            min_segment_bytes=min_segment_bytes,
        )
    metrics.budget_bytes.set(budget)
    metrics.resident_bytes.set(store.stats().resident_bytes)
    return store, budget


def describe_cache(reply: expert_pb2.DescribeResponse, stats: StoreStats) -> None:
    """Copy the store's counters into a DescribeResponse."""
    reply.cache_hits = stats.hits
    reply.cache_misses = stats.misses
    reply.cache_evictions = stats.evictions
    reply.bytes_read = stats.bytes_read
    reply.read_seconds = stats.read_seconds
    reply.read_gbps = stats.read_gbps
    reply.read_failures = stats.read_failures
    reply.cache_slots = stats.slots
    reply.io_mode = stats.io_mode
    reply.cache_policy = stats.policy
