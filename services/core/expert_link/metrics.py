"""Prometheus metrics of core's expert links (prometheus_client's default registry).

Served by `--metrics-port` / `[core] metrics`. Per layer: the latency of the whole layer
call as the engine sees it (retries included). Per worker: calls, failures by gRPC code,
retries (a failed part moved to another replica), and whether the link is up. Label
values are bounded: layers by the model, workers by the cluster file.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# 100 us .. ~13 s: a loopback call on an idle GPU box is ~300 us, a prefill over 10 GbE seconds.
_BUCKETS = tuple(1e-4 * 2**i for i in range(18))

LAYER_CALL_SECONDS = Histogram(
    "moe_mesh_expert_layer_call_seconds",
    "Wall time of one MoE layer's expert call from core, all workers and retries included",
    ["layer"],
    buckets=_BUCKETS,
)
WORKER_CALLS = Counter(
    "moe_mesh_expert_worker_calls_total", "ExpertCall messages sent to a worker", ["worker"]
)
WORKER_ERRORS = Counter(
    "moe_mesh_expert_worker_errors_total",
    "Failed calls to a worker, by gRPC status code",
    ["worker", "code"],
)
WORKER_RETRIES = Counter(
    "moe_mesh_expert_worker_retries_total",
    "Parts of a layer call that failed on this worker and were retried on a replica",
    ["worker"],
)
WORKER_UP = Gauge(
    "moe_mesh_expert_worker_up", "1 while core has a live link to the worker, else 0", ["worker"]
)
LAYER_CALL_FAILURES = Counter(
    "moe_mesh_expert_layer_call_failures_total",
    "Layer calls that failed after every replica was tried",
    ["code"],
)
LAYER_CALLS_PIPELINED = Counter(
    "moe_mesh_expert_layer_calls_pipelined_total",
    "Layer calls sent while another micro-batch's call was still computing (--micro-batches)",
)
