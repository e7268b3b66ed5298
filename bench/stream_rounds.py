"""Decode rounds through real processes, each round between two iobench probes of the same files.

The disk of a shared VM drifts from second to second (this one between ~0.9 and ~1.6 GB/s), so
a decode's read rate is only comparable with the disk measured right before and right after
it. `decode_rounds` starts one expert worker (and a core) and alternates: probe, decode a few
tokens, probe, decode, ... Every probe reads whole records at every queue depth, cold (direct
I/O, or the page cache dropped), with a fresh random order so no probe rereads the last one's.
Used by bench/stream.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
from pathlib import Path

import grpc

from services.common.manifest import Manifest
from services.experts.io import drop_page_cache
from services.experts.iobench import measure, measure_paced
from services.experts.store_setup import TRACE_ENV
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc, expert_pb2, expert_pb2_grpc
from tests.helpers import spawn, stop, wait_serving

PROMPT = [785, 3974, 315, 9625, 374, 12095, 13, 576, 6722, 315, 15344, 374, 11099, 13, 576, 6722, 315]
QUEUE_DEPTHS = (1, 2, 4, 8, 16, 32)
PACED = "qd1_paced"  # queue depth 1, 20 ms idle before each read: a decoding worker's cadence
PACED_READS, PACED_GAP_S = 16, 0.02


def probe(files: list[Path], record_size: int, mode: str, seconds: float, seed: int) -> dict[str, float]:
    """GB/s at every queue depth, whole records, cold; `seconds` and >= 4 reads per thread each.

    Plus PACED: the same reads one at a time after an idle gap (see iobench.measure_paced).
    """
    out = {
        str(qd): measure(files, record_size, mode, qd, seconds, seed=seed * 1000 + qd)["gbps"]
        for qd in QUEUE_DEPTHS
    }
    out[PACED] = measure_paced(files, record_size, mode, PACED_READS, PACED_GAP_S, seed=seed)["gbps"]
    return out


class ColdPageCache:
    """Drops the files' cached pages every `interval` s while active (a buffered decode stays cold).

    Without it a buffered worker would serve an expert it evicted a moment ago from the page cache,
    at memory speed, and its "disk" rate would beat the cold iobench it is compared with.
    """

    def __init__(self, files: list[Path], interval: float = 0.1):
        self._files, self._interval = files, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for path in self._files:
                drop_page_cache(path)

    def __enter__(self) -> ColdPageCache:
        for path in self._files:
            drop_page_cache(path)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rss_peak_mb(pid: int) -> int:
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["VmHWM"].split()[0]) // 1024
    except OSError:
        return 0


def describe(address: str) -> expert_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return expert_pb2_grpc.ExpertWorkerStub(channel).Describe(expert_pb2.DescribeRequest(), timeout=30)


def generate_round(core_address: str, worker_address: str, tokens: int, seed: int) -> dict:
    """Decode `tokens` (seeded sampling); the worker's counters over the decode steps only."""
    request = core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=PROMPT),
        sampling=core_pb2.SamplingParams(temperature=1.0, seed=seed),
        stopping=core_pb2.StoppingCriteria(max_tokens=tokens, ignore_eos=True),
    )

    async def generate():
        out, first = [], None
        async with grpc.aio.insecure_channel(core_address) as channel:
            async for chunk in core_pb2_grpc.CoreStub(channel).Generate(request, timeout=1800):
                if first is None and chunk.token_ids:
                    first = (time.perf_counter(), await asyncio.to_thread(describe, worker_address))
                out.extend(chunk.token_ids)
        return out, first, time.perf_counter()

    out, (t_first, before), t_end = asyncio.run(generate())
    after = describe(worker_address)
    # The first token's time is measured after Describe returned; decode = the other tokens.
    return {
        "tokens": len(out),
        "seconds": t_end - t_first,
        "hits": after.cache_hits - before.cache_hits,
        "misses": after.cache_misses - before.cache_misses,
        "bytes": after.bytes_read - before.bytes_read,
        "read_seconds": after.read_seconds - before.read_seconds,
        "evictions": after.cache_evictions - before.cache_evictions,
        "slots": after.cache_slots,
        "token_ids_head": list(out[:8]),
    }


def decode_rounds(
    split: Path,
    workdir: Path,
    *,
    rounds: int,
    tokens: int,
    memory_gb: float | None,
    io: str,
    policy: str,
    worker_flags: tuple[str, ...] = (),
    probe_seconds: float = 0.2,
    trace: Path | None = None,
) -> dict:
    """One worker (+ core) at this budget: `rounds` x (decode `tokens`), probes between them."""
    manifest = Manifest.load(split)
    files = [split / layer.file for layer in manifest.layers]
    record_size = manifest.layers[0].record_size
    streaming = memory_gb is not None
    tag = f"{io}-{policy}-{memory_gb}-{'_'.join(worker_flags)}"
    worker_address, core_address = f"unix:{workdir / f'{tag}.w.sock'}", f"unix:{workdir / f'{tag}.c.sock'}"
    args = ["expert", "--split", str(split), "--listen", worker_address, "--io", io, "--cache-policy", policy]
    if streaming:
        args += ["--memory-gb", f"{memory_gb:.6f}", *worker_flags]
    env_before = os.environ.get(TRACE_ENV)
    if trace is not None:
        os.environ[TRACE_ENV] = str(trace)
    worker = spawn(args, workdir / f"{tag}.w.log")
    if env_before is None:
        os.environ.pop(TRACE_ENV, None)
    core = None
    probes, results = [], []
    clock = {"start": time.perf_counter(), "probe_s": 0.0}
    try:
        wait_serving(worker_address, worker, timeout_s=600, log_path=workdir / f"{tag}.w.log")
        core = spawn(
            ["core", "--split", str(split), "--listen", core_address, "--worker", worker_address],
            workdir / f"{tag}.c.log",
        )
        wait_serving(core_address, core, timeout_s=600, log_path=workdir / f"{tag}.c.log")
        clock["ready"] = time.perf_counter()

        def timed_probe(seed: int) -> None:
            began = time.perf_counter()
            probes.append(probe(files, record_size, io, probe_seconds, seed=seed))
            clock["probe_s"] += time.perf_counter() - began

        if streaming:
            timed_probe(0)
        for index in range(rounds):
            cold = ColdPageCache(files) if streaming and io == "buffered" else contextlib.nullcontext()
            with cold:
                results.append(generate_round(core_address, worker_address, tokens, seed=7 + index))
            if streaming:
                timed_probe(index + 1)
        peak = rss_peak_mb(worker.pid)
    finally:
        stop([p for p in (core, worker) if p is not None])
    seconds = {
        "start_s": round(clock["ready"] - clock["start"], 1),
        "rounds_s": round(time.perf_counter() - clock["ready"] - clock["probe_s"], 1),
        "probes_s": round(clock["probe_s"], 1),
    }
    return {"rounds": results, "probes": probes, "worker_peak_rss_mb": peak, "wall": seconds}


def spread(values: list[float], digits: int = 3) -> dict:
    """Median and range (and quartiles from 4 values on) of a small sample."""
    values = sorted(values)
    out = {"median": round(statistics.median(values), digits), "min": round(values[0], digits)}
    out["max"] = round(values[-1], digits)
    if len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4)
        out["q1"], out["q3"] = round(q1, digits), round(q3, digits)
    out["n"] = len(values)
    return out
