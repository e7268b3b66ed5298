"""Prometheus metrics of core's step loop (prometheus_client's default registry).

With `moe_mesh_expert_worker_calls_total` (expert_metrics) these show how many expert calls
a step costs: one per worker per MoE layer however many forwards the step merges.
"""

from __future__ import annotations

from prometheus_client import Counter

from services.common.logging import get_logger

log = get_logger(__name__)

ENGINE_STEPS = Counter("moe_mesh_engine_steps_total", "Engine steps that ran at least one model forward")
ENGINE_FORWARDS = Counter(
    "moe_mesh_engine_forwards_total",
    "Model forwards run (decode, prompts joining, prefill chunks); a step merges its forwards' expert calls",
)


def record_step(pacer, forwards: int, prefilled: int, decoding: int, seconds: float) -> None:
    """A step that ran `forwards` model forwards: counted, and timed for the prefill pacer."""
    ENGINE_STEPS.inc()
    ENGINE_FORWARDS.inc(forwards)
    pacer.observe(seconds, prefilled, decoding)
    if prefilled:
        log.debug("prefill_step", tokens=prefilled, decoding=decoding, seconds=round(seconds, 3))
