"""Per-call timing shared by the benches: warm up, time each call, report percentiles in µs."""

from __future__ import annotations

import time

import mlx.core as mx
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


def step_split_us(build, steps: int, per: int, warm: int = 4) -> tuple[float, float]:
    """(host µs, step µs) per unit, medians over `steps` steps after the first `warm`: `build(i)`
    builds step i's graph and returns what to evaluate (host: building it; step: building,
    running and waiting for it, once per step as a decode step runs); both divided by `per`
    (the layer calls one step makes)."""
    host, step = [], []
    for i in range(steps):
        begin = time.perf_counter()
        outputs = build(i)
        built = time.perf_counter()
        mx.eval(outputs)
        done = time.perf_counter()
        host.append((built - begin) / per)
        step.append((done - begin) / per)
    warm = min(warm, steps - 1)  # the first steps compile kernels and graphs
    return tuple(round(1e6 * float(np.median(xs[warm:])), 1) for xs in (host, step))
