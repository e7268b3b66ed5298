"""Prometheus metrics of core's step loop (prometheus_client's default registry).

With `moe_mesh_expert_worker_calls_total` (expert_metrics) these show how many expert calls
a step costs: one per worker per MoE layer however many forwards the step merges.
"""

from __future__ import annotations

from prometheus_client import Counter

ENGINE_STEPS = Counter("moe_mesh_engine_steps_total", "Engine steps that ran at least one model forward")
ENGINE_FORWARDS = Counter(
    "moe_mesh_engine_forwards_total",
    "Model forwards run (decode, prompts joining, prefill chunks); a step merges its forwards' expert calls",
)
