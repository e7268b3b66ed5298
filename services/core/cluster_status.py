"""Core's view of the whole cluster for `Core.GetStats` and `Core.GetMetrics`: its own counters,
each worker it was given (up or down, what it serves, its expert cache), per-layer hop latency,
and every service's Prometheus exposition relayed through one call."""

from __future__ import annotations

import asyncio

import grpc
import mlx.core as mx
import numpy as np
from prometheus_client import REGISTRY, generate_latest

from services.common.ranges import format_ranges
from services.core.engine import Engine
from services.proto.moemesh.v1 import core_pb2, expert_pb2

DESCRIBE_TIMEOUT_S = 0.5  # a worker that cannot answer Describe this fast shows its last answer


def fill_core_stats(stats: core_pb2.CoreStats, engine: Engine) -> None:
    """Everything core knows by itself: requests, tokens, KV and prefix cache, problems."""
    counters = engine.counters
    stats.running_requests = engine.running
    stats.waiting_requests = engine.waiting
    stats.prompt_tokens_total = counters.prompt_tokens
    stats.generation_tokens_total = counters.generation_tokens
    stats.kv_cache_bytes = engine.kv_cache_bytes
    stats.kv_cache_capacity_bytes = engine.kv_cache_capacity_bytes
    stats.kv_cache_default = engine.config.kv_cache
    stats.problems.extend(engine.problems)
    stats.mlx_active_bytes = mx.get_active_memory()
    stats.mlx_cache_bytes = mx.get_cache_memory()
    prefix = engine.prefix_cache
    stats.prefix_cache.lookups = prefix.counters.lookups
    stats.prefix_cache.hits = prefix.counters.hits
    stats.prefix_cache.hit_tokens = prefix.counters.hit_tokens
    stats.prefix_cache.entries = prefix.entries
    stats.prefix_cache.bytes = prefix.nbytes
    stats.prefix_cache.budget_bytes = prefix.budget_bytes
    vision = engine.prompt_start.vision
    if vision is not None:
        images = vision.features
        stats.image_cache.hits, stats.image_cache.misses = images.hits, images.misses
        stats.image_cache.entries, stats.image_cache.bytes = len(images), images.nbytes
        stats.image_cache.budget_bytes = images.budget_bytes
    if engine.config.speculative is not None:
        speculative = counters.speculative
        stats.speculative.method = engine.config.speculative.method
        stats.speculative.drafts = speculative.drafts
        stats.speculative.draft_tokens = speculative.draft_tokens
        stats.speculative.accepted_tokens = speculative.accepted_tokens
        used = engine.config.speculative.num_speculative_tokens
        stats.speculative.accepted_per_position.extend(speculative.accepted_per_position[:used])


def fill_layer_latency(stats: core_pb2.CoreStats, engine: Engine) -> None:
    if engine.layer_call_timings is None:
        return
    for layer, totals in sorted(engine.layer_call_timings.by_layer().items()):
        if len(totals):
            p50, p99 = np.percentile(totals, [50, 99])
            stats.layer_latency.add(layer=layer, calls=len(totals), p50_us=float(p50), p99_us=float(p99))


async def describe_workers(dispatcher, include_metrics: bool = False) -> list[tuple]:
    """(link, its Describe answered now, or why not as a str) for every link; runs the calls on
    the dispatcher's I/O loop, where its channels live."""

    async def one(link):
        request = expert_pb2.DescribeRequest(include_metrics=include_metrics)
        try:
            return link, await link.stub.Describe(request, timeout=DESCRIBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            return link, f"{error.code().name}: {error.details()}"

    async def all_links():
        return await asyncio.gather(*(one(link) for link in list(dispatcher.links)))

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(all_links(), dispatcher.loop))


def fill_workers(stats: core_pb2.CoreStats, dispatcher, replies: list[tuple]) -> None:
    """One WorkerStatus per link: state from core's routing, holdings and cache from `replies`
    (describe_workers) or, for a worker that did not answer, its last Describe."""
    replicas = dispatcher.replica_counts()
    for link, reply in replies:
        fresh = isinstance(reply, expert_pb2.DescribeResponse)
        status = stats.workers.add(
            address=link.address,
            up=link.up,
            last_error=link.last_error or ("" if fresh else reply),
            calls=link.calls,
            errors=link.errors,
            retries=link.retries,
        )
        describe = reply if fresh else link.last_describe
        if describe is None:
            continue
        status.worker_id = describe.worker_id
        status.layers = format_ranges([held.layer for held in describe.layers])
        status.experts = format_ranges(sorted({e for held in describe.layers for e in held.experts}))
        counts = [
            int(replicas[held.layer][e])
            for held in describe.layers
            if held.layer in replicas
            for e in held.experts
            if e < len(replicas[held.layer])
        ]
        status.min_replicas = min(counts) if counts else 0
        status.memory_budget_bytes = describe.memory_budget_bytes
        status.resident_bytes = describe.resident_bytes
        status.cache_hits = describe.cache_hits
        status.cache_misses = describe.cache_misses
        status.bytes_read = describe.bytes_read
        status.read_gbps = describe.read_gbps


async def cluster_stats(engine: Engine) -> core_pb2.CoreStats:
    """CoreStats with the workers and per-layer latency filled in."""
    stats = core_pb2.CoreStats()
    fill_core_stats(stats, engine)
    fill_layer_latency(stats, engine)
    dispatcher = engine.expert_links
    if dispatcher is not None and dispatcher.links:
        fill_workers(stats, dispatcher, await describe_workers(dispatcher))
    return stats


async def cluster_metrics(engine: Engine) -> core_pb2.GetMetricsResponse:
    """Core's Prometheus exposition and every worker's, as each answered it."""
    out = core_pb2.GetMetricsResponse()
    out.services.add(service="core", text=generate_latest(REGISTRY).decode())
    dispatcher = engine.expert_links
    if dispatcher is not None and dispatcher.links:
        for link, reply in await describe_workers(dispatcher, include_metrics=True):
            fresh = isinstance(reply, expert_pb2.DescribeResponse)
            out.services.add(
                service="expert",
                worker=link.address,
                text=reply.metrics_text if fresh else "",
                error="" if fresh else reply,
            )
    return out
