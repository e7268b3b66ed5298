"""The periodic stats line, as vLLM prints it: every 10 s while core is busy, one `stats` log
event with prompt and generation throughput, running and waiting requests, KV cache use, the
prefix cache's hit rate, drafted tokens accepted (with --speculative), the expert hop's p50, and
the workers' expert cache hit rate and SSD read rate over that interval. `moe-mesh up` shows it on its terminal; `--quiet` turns it off."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.common.logging import get_logger
from services.proto.moemesh.v1 import core_pb2

log = get_logger("stats")
STATS_EVENT = "stats"
STATS_EVERY_S = 10.0


@dataclass
class _Totals:
    at: float
    prompt: int
    generation: int
    lookups: int
    hits: int
    cache_hits: int
    cache_misses: int
    bytes_read: int
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def of(cls, stats: core_pb2.CoreStats, at: float) -> _Totals:
        workers = list(stats.workers)
        return cls(
            at,
            stats.prompt_tokens_total,
            stats.generation_tokens_total,
            stats.prefix_cache.lookups,
            stats.prefix_cache.hits,
            sum(w.cache_hits for w in workers),
            sum(w.cache_misses for w in workers),
            sum(w.bytes_read for w in workers),
            stats.speculative.draft_tokens,
            stats.speculative.accepted_tokens,
        )


def stats_fields(stats: core_pb2.CoreStats, now: _Totals, before: _Totals) -> dict | None:
    """The line's fields for the interval from `before` to `now`; None when core was idle."""
    span = max(now.at - before.at, 1e-9)
    prompt, generation = now.prompt - before.prompt, now.generation - before.generation
    if not (prompt or generation or stats.running_requests or stats.waiting_requests):
        return None
    lookups, hits = now.lookups - before.lookups, now.hits - before.hits
    accesses = (now.cache_hits - before.cache_hits) + (now.cache_misses - before.cache_misses)
    capacity = stats.kv_cache_capacity_bytes
    fields = {
        "prompt_tok_s": round(prompt / span, 1),
        "generation_tok_s": round(generation / span, 1),
        "running": stats.running_requests,
        "waiting": stats.waiting_requests,
        "kv_cache_pct": round(100 * stats.kv_cache_bytes / capacity, 1) if capacity else None,
        "prefix_cache_hit_pct": round(100 * hits / lookups, 1) if lookups else None,
    }
    drafted = now.draft_tokens - before.draft_tokens
    if stats.speculative.method:
        accepted = now.accepted_tokens - before.accepted_tokens
        fields["draft_acceptance_pct"] = round(100 * accepted / drafted, 1) if drafted else None
    latencies = sorted(entry.p50_us for entry in stats.layer_latency)
    if latencies:
        fields["hop_p50_us"] = round(latencies[len(latencies) // 2])
    if stats.workers:
        fields["expert_cache_hit_pct"] = (
            round(100 * (now.cache_hits - before.cache_hits) / accesses, 1) if accesses else None
        )
        fields["ssd_gb_s"] = round((now.bytes_read - before.bytes_read) / span / 1e9, 3)
        down = [w.worker_id or w.address for w in stats.workers if not w.up]
        if down:
            fields["workers_down"] = down
    return fields


async def log_stats_lines(read_stats, every_s: float = STATS_EVERY_S) -> None:
    """Forever: `read_stats()` (an awaitable CoreStats) every `every_s`, a line when busy."""
    before = _Totals.of(await read_stats(), time.monotonic())
    while True:
        await asyncio.sleep(every_s)
        stats = await read_stats()
        now = _Totals.of(stats, time.monotonic())
        if (fields := stats_fields(stats, now, before)) is not None:
            log.info(STATS_EVENT, **fields)
        before = now
