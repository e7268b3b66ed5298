"""The status page's data (`GET /status.json`) from core's CoreStats: the cluster map, per-layer
hop latency, the workers' expert caches, KV and prefix cache, requests, and tok/s over the last
minutes (a history the gateway samples itself)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from services.proto.moemesh.v1 import core_pb2

HISTORY_S = 600.0  # tok/s over the last ten minutes
SAMPLE_EVERY_S = 5.0


class ThroughputHistory:
    """Core's token counters sampled over time; tok/s between consecutive samples."""

    def __init__(self, keep_s: float = HISTORY_S):
        self.keep_s = keep_s
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, prompt total, generation total)

    def add(self, stats: core_pb2.CoreStats, now: float | None = None) -> None:
        now = time.time() if now is None else now
        sample = (now, stats.prompt_tokens_total, stats.generation_tokens_total)
        if self._samples and sample[1] < self._samples[-1][1]:
            self._samples.clear()  # core restarted: its counters began again
        if self._samples and now - self._samples[-1][0] < 1.0:
            return  # a page open in several tabs: one sample a second is enough
        self._samples.append(sample)
        while self._samples and now - self._samples[0][0] > self.keep_s:
            self._samples.popleft()

    def rates(self) -> list[dict[str, float]]:
        out = []
        for (t0, p0, g0), (t1, p1, g1) in zip(self._samples, list(self._samples)[1:], strict=False):
            span = max(t1 - t0, 1e-9)
            out.append(
                {
                    "t": round(t1, 3),
                    "generation_tok_s": round((g1 - g0) / span, 2),
                    "prompt_tok_s": round((p1 - p0) / span, 2),
                }
            )
        return out


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _host(address: str) -> str:
    if address.startswith("unix:"):
        return "this host"
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def worker_json(worker: core_pb2.WorkerStatus) -> dict[str, Any]:
    accesses = worker.cache_hits + worker.cache_misses
    return {
        "name": worker.worker_id or worker.address,
        "address": worker.address,
        "host": _host(worker.address),
        "up": worker.up,
        "last_error": worker.last_error,
        "layers": worker.layers,
        "experts": worker.experts,
        "min_replicas": worker.min_replicas,
        "memory_budget_bytes": worker.memory_budget_bytes,
        "resident_bytes": worker.resident_bytes,
        "cache_hits": worker.cache_hits,
        "cache_misses": worker.cache_misses,
        "cache_hit_rate": _ratio(worker.cache_hits, accesses),
        "bytes_read": worker.bytes_read,
        "read_gbps": round(worker.read_gbps, 3),
        "calls": worker.calls,
        "errors": worker.errors,
        "retries": worker.retries,
    }


def core_json(stats: core_pb2.CoreStats | None, health: str, address: str) -> dict[str, Any]:
    if stats is None:
        state = "unreachable"
        stats = core_pb2.CoreStats()
    else:
        state = "serving" if health == "SERVING" and not stats.problems else "not_serving"
    prefix = stats.prefix_cache
    spec = stats.speculative
    return {
        "speculative": {
            "method": spec.method,
            "drafts": spec.drafts,
            "draft_tokens": spec.draft_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "acceptance_rate": _ratio(spec.accepted_tokens, spec.draft_tokens),
        }
        if spec.method
        else None,
        "state": state,
        "address": address,
        "problems": list(stats.problems),
        "running": stats.running_requests,
        "waiting": stats.waiting_requests,
        "kv_cache_bytes": stats.kv_cache_bytes,
        "kv_cache_capacity_bytes": stats.kv_cache_capacity_bytes,
        "mlx_active_bytes": stats.mlx_active_bytes,
        "mlx_cache_bytes": stats.mlx_cache_bytes,
        "prompt_tokens_total": stats.prompt_tokens_total,
        "generation_tokens_total": stats.generation_tokens_total,
        "prefix_cache": {
            "lookups": prefix.lookups,
            "hits": prefix.hits,
            "hit_rate": _ratio(prefix.hits, prefix.lookups),
            "hit_tokens": prefix.hit_tokens,
            "entries": prefix.entries,
            "bytes": prefix.bytes,
            "budget_bytes": prefix.budget_bytes,
        },
    }


def status_json(
    stats: core_pb2.CoreStats | None,
    *,
    health: str,
    model: str,
    version: str,
    core_address: str,
    gateway_address: str,
    history: ThroughputHistory,
) -> dict[str, Any]:
    """What `/status.json` answers; `stats` None: core did not answer."""
    workers = list(stats.workers) if stats is not None else []
    layers = list(stats.layer_latency) if stats is not None else []
    return {
        "model": model,
        "version": version,
        "time": round(time.time(), 3),
        "gateway": {"address": gateway_address, "up": True},
        "core": core_json(stats, health, core_address),
        "workers": [worker_json(w) for w in workers],
        "layers": [
            {
                "layer": entry.layer,
                "calls": entry.calls,
                "p50_us": round(entry.p50_us, 1),
                "p99_us": round(entry.p99_us, 1),
            }
            for entry in layers
        ],
        "throughput": history.rates(),
    }
