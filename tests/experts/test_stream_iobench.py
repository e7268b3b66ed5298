"""iobench's probes as bench/stream.py uses them: enough reads at every queue depth, cold."""

from __future__ import annotations

import time

from services.common.manifest import Manifest
from services.experts.iobench import measure


def test_each_queue_depth_reads_at_least_four_records_per_thread_however_short(tiny_models):
    split = tiny_models.split("mixtral", None)
    manifest = Manifest.load(split)
    files = [split / layer.file for layer in manifest.layers]
    record = manifest.layers[0].record_size
    for mode in ("direct", "buffered"):
        for queue_depth in (1, 8):
            result = measure(files, record, mode, queue_depth, seconds=0.0, seed=3)
            assert result["reads"] >= 4 * queue_depth
            assert result["gbps"] > 0 and 0 < result["p50_us"] <= result["p99_us"]
    asked = measure(files, record, "direct", 2, seconds=0.0, min_reads=50)
    assert asked["reads"] >= 50


def test_paced_reads_go_one_at_a_time_after_the_gap(tiny_models):
    from services.experts.iobench import measure_paced

    split = tiny_models.split("mixtral", None)
    manifest = Manifest.load(split)
    files = [split / layer.file for layer in manifest.layers]
    started = time.perf_counter()
    result = measure_paced(files, manifest.layers[0].record_size, "direct", reads=5, gap_s=0.01)
    assert time.perf_counter() - started >= 5 * 0.01  # the gaps were slept, not skipped
    assert result["reads"] == 5 and result["gbps"] > 0 and result["p50_us"] > 0
