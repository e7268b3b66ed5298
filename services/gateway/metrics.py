"""Prometheus metrics under the names vLLM uses, so existing vLLM dashboards work unchanged.

Contract: one `GatewayMetrics` per app, on its own registry (several apps in one process — tests —
do not collide). Latencies are measured at the gateway, the way a client sees them:
time to first token (request received → first token chunk), inter-token latency (gap between token
chunks, divided among the tokens a chunk carries), end-to-end latency; queue and prefill time come
from core's `RequestTimings`. Running and waiting requests are core's own gauges, read from
`Core.GetStats` at scrape time (the gateway alone cannot see the queue). Every series carries
`model_name`, as vLLM's do.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.gateway.chat_format import finish_reason_name
from services.gateway.generation_state import GenerationState
from services.proto.moemesh.v1 import core_pb2

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics", "RequestTimer"]

# vLLM's bucket boundaries, so histograms line up with theirs on a shared dashboard.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        # The older name of the same series; Grafana dashboards from vLLM 0.6-0.9 still plot it.
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token (same as inter-token latency).",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting in core's queue.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "Time spent in prefill.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Successfully finished requests.",
            [*labels, "finished_reason"],
            registry=r,
        )

        def gauge(name: str, documentation: str) -> Gauge:  # one series per served model
            return Gauge(name, documentation, labels, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests being generated in core.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting in core's queue.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache bytes in use as a fraction of what the batch could fill (1 = full).",
        )
        self.kv_bytes = gauge("moe_mesh_kv_cache_bytes", "KV cache bytes of the requests in core.")
        self.prefix_lookups = gauge(
            "moe_mesh_prefix_cache_lookups", "Prompts looked up in core's prefix cache, since it started."
        )
        self.prefix_hits = gauge(
            "moe_mesh_prefix_cache_hits", "Lookups that reused cached tokens, since core started."
        )
        self.prefix_hit_tokens = gauge(
            "moe_mesh_prefix_cache_hit_tokens", "Prompt tokens not recomputed, since core started."
        )
        self.prefix_bytes = gauge("moe_mesh_prefix_cache_bytes", "Bytes the prefix cache holds.")
        self.image_hits = gauge(
            "moe_mesh_image_cache_hits", "Images whose vision-tower output core reused, since it started."
        )
        self.image_misses = gauge(
            "moe_mesh_image_cache_misses", "Images core's vision tower encoded, since it started."
        )
        self.image_bytes = gauge("moe_mesh_image_cache_bytes", "Bytes of vision-tower outputs core keeps.")

    def set_core_gauges(self, model: str, stats: core_pb2.CoreStats) -> None:
        self.running.labels(model).set(stats.running_requests)
        self.waiting.labels(model).set(stats.waiting_requests)
        capacity = stats.kv_cache_capacity_bytes
        self.kv_usage.labels(model).set(stats.kv_cache_bytes / capacity if capacity else 0.0)
        self.kv_bytes.labels(model).set(stats.kv_cache_bytes)
        prefix = stats.prefix_cache
        self.prefix_lookups.labels(model).set(prefix.lookups)
        self.prefix_hits.labels(model).set(prefix.hits)
        self.prefix_hit_tokens.labels(model).set(prefix.hit_tokens)
        self.prefix_bytes.labels(model).set(prefix.bytes)
        images = stats.image_cache
        self.image_hits.labels(model).set(images.hits)
        self.image_misses.labels(model).set(images.misses)
        self.image_bytes.labels(model).set(images.bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request's tokens as they pass through the gateway and records them once it ends."""

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.started = time.perf_counter()
        self._last_token: float | None = None
        self._gaps: list[tuple[float, int]] = []
        self.first_token_s: float | None = None

    def on_chunk(self, chunk: core_pb2.GenerateChunk) -> None:
        tokens = len(chunk.token_ids)
        if not tokens:
            return
        now = time.perf_counter()
        if self._last_token is None:
            self.first_token_s = now - self.started
        else:
            self._gaps.append(((now - self._last_token) / tokens, tokens))
        self._last_token = now

    def finished(self, state: GenerationState) -> None:
        """Record a request that ended with a finish reason (errors and disconnects are not successes)."""
        model = self.model
        m = self.metrics
        m.e2e.labels(model).observe(time.perf_counter() - self.started)
        if self.first_token_s is not None:
            m.ttft.labels(model).observe(self.first_token_s)
        inter_token = m.inter_token.labels(model)
        time_per_output_token = m.time_per_output_token.labels(model)
        for per_token, count in self._gaps:
            for _ in range(count):
                inter_token.observe(per_token)
                time_per_output_token.observe(per_token)
        if state.queue_seconds is not None:
            m.queue.labels(model).observe(state.queue_seconds)
        if state.prefill_seconds is not None:
            m.prefill.labels(model).observe(state.prefill_seconds)
        m.prompt_tokens.labels(model).inc(state.prompt_tokens)
        m.generation_tokens.labels(model).inc(state.completion_tokens)
        if state.finish_reason is not None:
            m.success.labels(model, finish_reason_name(state.finish_reason)).inc()
