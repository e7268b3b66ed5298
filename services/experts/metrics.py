"""Prometheus metrics of an expert worker's cache, on prometheus_client's default REGISTRY.

Whoever serves the registry (the metrics endpoint) exposes these; the streaming store
records into them once per load, so the cost is a few lock-protected adds per call.
Counters are process-wide, as Prometheus expects of one worker process.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge


class ExpertCacheMetrics:
    """moe_mesh_expert_cache_* counters and gauges; one instance per registry."""

    _by_registry: dict[int, ExpertCacheMetrics] = {}

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.hits = Counter(
            "moe_mesh_expert_cache_hits", "Expert accesses served from RAM", registry=registry
        )
        self.misses = Counter(
            "moe_mesh_expert_cache_misses", "Expert accesses that read the layer file", registry=registry
        )
        self.evictions = Counter(
            "moe_mesh_expert_cache_evictions", "Experts evicted to make room", registry=registry
        )
        self.bytes_read = Counter(
            "moe_mesh_expert_read_bytes", "Bytes read from expert layer files", registry=registry
        )
        self.read_seconds = Counter(
            "moe_mesh_expert_read_seconds",
            "Wall time spent waiting for expert reads (all reads of a call overlap)",
            registry=registry,
        )
        self.read_failures = Counter(
            "moe_mesh_expert_read_failures",
            "Expert reads that failed (call answered with an error)",
            registry=registry,
        )
        self.budget_bytes = Gauge(
            "moe_mesh_expert_memory_budget_bytes",
            "Expert memory budget (0 = all resident)",
            registry=registry,
        )
        self.resident_bytes = Gauge(
            "moe_mesh_expert_resident_bytes", "Bytes of expert weights held in RAM", registry=registry
        )

    @classmethod
    def for_registry(cls, registry: CollectorRegistry = REGISTRY) -> ExpertCacheMetrics:
        """The one instance for `registry` (registering the same names twice is an error)."""
        key = id(registry)
        if key not in cls._by_registry:
            cls._by_registry[key] = cls(registry)
        return cls._by_registry[key]

    def record(self, hits: int, misses: int, nbytes: int, seconds: float, failures: int) -> None:
        if hits:
            self.hits.inc(hits)
        if misses:
            self.misses.inc(misses)
        if nbytes:
            self.bytes_read.inc(nbytes)
        if seconds:
            self.read_seconds.inc(seconds)
        if failures:
            self.read_failures.inc(failures)

    def evicted(self, count: int) -> None:
        self.evictions.inc(count)
