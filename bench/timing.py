"""Per-call timing shared by the benches: warm up, time each call, report percentiles in µs."""

from __future__ import annotations

import time

import numpy as np


def percentiles(samples: list[float]) -> dict:
    p50, p99 = np.percentile(np.array(samples), [50, 99])
    return {"p50_us": round(float(p50), 1), "p99_us": round(float(p99), 1)}


def timed(fn, calls: int, warmup: int = 20) -> dict:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return percentiles(samples)
