"""`moe-mesh iobench PATH`: random-read GB/s of this disk at the expert record size.

Reads whole records at random record-aligned offsets of a split's layer files (or of
any file), from N threads at once (queue depth N), with direct I/O and through the
page cache. Before each buffered run the files' cached pages are dropped
(POSIX_FADV_DONTNEED, no root needed), so both modes start cold; reads follow a
shuffled order of all records, and the page cache is dropped again each time all were read
once, so small files stay cold too.
The same code measures the disk for bench/stream.py, so the ratio it reports compares
like with like.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from services.common.manifest import Manifest
from services.experts.io import aligned_buffer, drop_page_cache, open_record_file


def record_files(path: Path, record_size: int | None) -> tuple[list[Path], int]:
    """The files to read and the record size: a split's layer files, or one file."""
    if (path / "manifest.json").exists():
        manifest = Manifest.load(path)
        files = [path / layer.file for layer in manifest.layers]
        return files, record_size or max(layer.record_size for layer in manifest.layers)
    if path.is_file():
        return [path], record_size or (1 << 20)
    raise ValueError(f"{path}: neither a split folder (manifest.json) nor a file")


def _open_cold(files: list[Path], record_size: int, mode: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Open `files` for `mode` with nothing of them in the page cache; every record's (fd, offset)."""
    fds = [open_record_file(f, mode) for f in files]
    try:
        if mode == "buffered":
            for f in files:
                drop_page_cache(f)
        slots = [
            (fd, i * record_size)
            for fd, f in zip(fds, files, strict=True)
            for i in range(os.path.getsize(f) // record_size)
        ]
        if not slots:
            raise ValueError(f"files smaller than one record ({record_size} bytes)")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, slots


def measure(
    files: list[Path],
    record_size: int,
    mode: str,
    queue_depth: int,
    seconds: float,
    min_reads: int = 0,
    seed: int | None = None,
) -> dict:
    """One (mode, queue depth) run: GB/s and per-read latency percentiles.

    Runs for `seconds` and until `min_reads` reads were issued (default: 4 per thread, so a deep
    queue is measured at full depth, not while its threads start and finish). Repeated runs
    should pass different `seeds`, so they read different records in a different order.
    """
    min_reads = min_reads or 4 * queue_depth
    fds, slots = _open_cold(files, record_size, mode)
    try:
        # the benchmark's read order, not a secret
        random.Random(queue_depth if seed is None else seed).shuffle(slots)  # nosec B311
        cursor = iter(range(1 << 62))
        lock = threading.Lock()
        deadline = time.perf_counter() + seconds
        totals = [0] * queue_depth
        latencies: list[list[float]] = [[] for _ in range(queue_depth)]

        def reader(index: int) -> None:
            buffer = aligned_buffer(record_size)
            while True:
                with lock:
                    turn = next(cursor)
                    if turn >= min_reads and time.perf_counter() >= deadline:
                        break
                    if mode == "buffered" and turn and turn % len(slots) == 0:
                        for f in files:  # every record read once: forget them before reading again
                            drop_page_cache(f)
                    fd, offset = slots[turn % len(slots)]
                start = time.perf_counter()
                got = os.preadv(fd, [buffer], offset)
                latencies[index].append(time.perf_counter() - start)
                totals[index] += got

        start = time.perf_counter()
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(queue_depth)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
    samples = sorted(x for per_thread in latencies for x in per_thread)
    pick = lambda q: round(samples[min(len(samples) - 1, int(q * len(samples)))] * 1e6) if samples else 0  # noqa: E731
    return {
        "gbps": round(sum(totals) / elapsed / 1e9, 3),
        "reads": len(samples),
        "p50_us": pick(0.5),
        "p99_us": pick(0.99),
    }


def measure_paced(
    files: list[Path], record_size: int, mode: str, reads: int, gap_s: float, seed: int = 0
) -> dict:
    """Queue depth 1 with an idle gap before every read, as a decoding worker reads.

    A worker reads a record or two per layer call and then computes for milliseconds; on some
    devices (this project's VM disk: ~25 % slower) a read after idle takes longer than one
    issued back to back, which the continuous runs of `measure` never see. GB/s here is bytes
    over the time spent inside the reads, the same definition as the worker's read GB/s.
    """
    fds, slots = _open_cold(files, record_size, mode)
    try:
        rng = random.Random(seed)  # nosec B311
        buffer = aligned_buffer(record_size)
        total, latencies = 0, []
        for _ in range(reads):
            time.sleep(gap_s)
            fd, offset = rng.choice(slots)
            start = time.perf_counter()
            total += os.preadv(fd, [buffer], offset)
            latencies.append(time.perf_counter() - start)
    finally:
        for fd in fds:
            os.close(fd)
    latencies.sort()
    return {
        "gbps": round(total / sum(latencies) / 1e9, 3) if latencies else 0.0,
        "reads": len(latencies),
        "p50_us": round(latencies[len(latencies) // 2] * 1e6) if latencies else 0,
    }


def run_iobench(
    path: Path,
    record_size: int | None = None,
    queue_depths: list[int] = (1, 2, 4, 8, 16, 32),
    modes: list[str] = ("direct", "buffered"),
    seconds: float = 1.0,
) -> dict:
    files, record_size = record_files(Path(path), record_size)
    if record_size % 4096:
        raise ValueError(
            f"record size {record_size} is not a multiple of 4096 (direct I/O needs aligned reads)"
        )
    results: dict[str, dict[str, dict]] = {}
    for mode in modes:
        results[mode] = {str(qd): measure(files, record_size, mode, qd, seconds) for qd in queue_depths}
    best = {
        mode: max(({"queue_depth": int(qd), **r} for qd, r in runs.items()), key=lambda r: r["gbps"])
        for mode, runs in results.items()
    }
    return {
        "path": str(path),
        "record_size": record_size,
        "file_bytes": sum(f.stat().st_size for f in files),
        "seconds_per_run": seconds,
        "gbps": {mode: {qd: r["gbps"] for qd, r in runs.items()} for mode, runs in results.items()},
        "runs": results,
        "best": best,
    }


def format_table(result: dict) -> str:
    lines = [
        f"{result['path']}: random reads of {result['record_size']} bytes over "
        f"{result['file_bytes'] / 1e9:.2f} GB, {result['seconds_per_run']} s per run (cold: direct I/O "
        "or dropped page cache)",
        f"{'queue depth':>12} "
        + " ".join(f"{mode + ' GB/s':>16} {'p50/p99 us':>14}" for mode in result["runs"]),
    ]
    depths = next(iter(result["runs"].values())).keys() if result["runs"] else []
    for qd in depths:
        cells = []
        for runs in result["runs"].values():
            r = runs[qd]
            cells.append(f"{r['gbps']:>16.3f} {str(r['p50_us']) + '/' + str(r['p99_us']):>14}")
        lines.append(f"{qd:>12} " + " ".join(cells))
    return "\n".join(lines)
