"""Expert streaming: decode with a worker whose RAM holds 25/50/100 % of the experts, vs the disk.

    python bench/stream.py                    # builds the model once (~3 GB on disk), then measures
    python bench/stream.py --layers 4 --tokens 16 --iobench-seconds 0.5     # quicker

One run measures, on the same files:
- `iobench`: the disk's random-read GB/s at the model's expert record size, queue depth 1-32,
  direct I/O and page cache (cold: direct, or the files' pages dropped first);
- decode through real processes (core + one expert worker over Unix sockets) at budgets of 25 %
  and 50 % of the expert bytes with direct I/O and with the page cache (dropped before the run),
  and at 100 % (every expert resident): tok/s, hit rate, and the worker's read GB/s while it
  streamed (bytes read / time its reads took) against iobench's GB/s at the same record size;
- the two cache policies (lru, lfu-decay) replayed on the recorded routing trace of a 25 % run,
  plus one decode run with the better one;
- prefetch: how many of a call's misses the obvious predictor (the experts this layer used on
  the previous token) would have fetched ahead, and the share of decode time spent reading — the
  most any prefetch could save.

The model is a random 4-bit qwen3_moe with Qwen3-30B-A3B's MoE shape (128 experts of ~3 MB per
layer, top-8) and `--layers` MoE layers. Sampling is seeded (temperature 1) so every run decodes
the same tokens with varied routing; greedy decoding of a random model loops on a few tokens and
would flatter the cache. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.manifest import Manifest
from services.common.synthetic_model import QWEN3_30B_A3B_SHAPE, build_random_checkpoint
from services.experts.cache_policy import make_policy
from services.experts.io import drop_page_cache
from services.experts.iobench import measure, run_iobench
from services.experts.store_setup import TRACE_ENV
from services.experts.streaming_store import expert_bytes
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc, expert_pb2, expert_pb2_grpc
from services.up import cache_root
from tests.helpers import spawn, stop, wait_serving

PROMPT = [785, 3974, 315, 9625, 374, 12095, 13, 576, 6722, 315, 15344, 374, 11099, 13, 576, 6722, 315]


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def bench_split(layers: int) -> Path:
    split = cache_root() / "bench" / f"stream-qwen3-30b-a3b-{layers}layer-q4-split"
    if not (split / "manifest.json").exists():
        from services.core.split import split_checkpoint

        checkpoint = cache_root() / "bench" / f".stream-{layers}layer-checkpoint"
        log(f"building the {layers}-layer 4-bit model (once) in {checkpoint}")
        config = {**QWEN3_30B_A3B_SHAPE, "num_hidden_layers": layers}
        build_random_checkpoint(checkpoint, config, bits=4, group_size=64)
        split_checkpoint(checkpoint, split, progress=False)
        shutil.rmtree(checkpoint)  # only the split is needed from here on
    return split


def rss_peak_mb(pid: int) -> int:
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["VmHWM"].split()[0]) // 1024
    except OSError:
        return 0


def describe(address: str) -> expert_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return expert_pb2_grpc.ExpertWorkerStub(channel).Describe(expert_pb2.DescribeRequest(), timeout=30)


def decode_run(
    split: Path, workdir: Path, tokens: int, memory_gb: float | None, io: str, policy: str, trace=None
):
    """One worker (+ core) at this budget; decode `tokens`; counters over the decode steps only."""
    manifest = Manifest.load(split)
    files = [split / layer.file for layer in manifest.layers]
    # The disk right before and after this run (other tenants make it drift from minute to minute).
    disk_before = adjacent_iobench(files, manifest.layers[0].record_size, io) if memory_gb else {}
    for path in files:
        drop_page_cache(path)
    tag = f"{io}-{policy}-{memory_gb}"
    worker_address, core_address = f"unix:{workdir / f'{tag}.w.sock'}", f"unix:{workdir / f'{tag}.c.sock'}"
    args = ["expert", "--split", str(split), "--listen", worker_address, "--io", io, "--cache-policy", policy]
    if memory_gb is not None:
        args += ["--memory-gb", f"{memory_gb:.6f}"]
    env_before = os.environ.get(TRACE_ENV)
    if trace is not None:
        os.environ[TRACE_ENV] = str(trace)
    worker = spawn(args, workdir / f"{tag}.w.log")
    if env_before is None:
        os.environ.pop(TRACE_ENV, None)
    core = None
    try:
        wait_serving(worker_address, worker, timeout_s=600, log_path=workdir / f"{tag}.w.log")
        core = spawn(
            ["core", "--split", str(split), "--listen", core_address, "--worker", worker_address],
            workdir / f"{tag}.c.log",
        )
        wait_serving(core_address, core, timeout_s=600, log_path=workdir / f"{tag}.c.log")
        request = core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=PROMPT),
            sampling=core_pb2.SamplingParams(temperature=1.0, seed=7),
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
        peak = rss_peak_mb(worker.pid)
    finally:
        stop([p for p in (core, worker) if p is not None])
    disk_after = adjacent_iobench(files, manifest.layers[0].record_size, io) if memory_gb else {}
    seconds = t_end - t_first
    # The first token's time is measured after Describe returned; decode = the other tokens.
    hits, misses = after.cache_hits - before.cache_hits, after.cache_misses - before.cache_misses
    nbytes, read_s = after.bytes_read - before.bytes_read, after.read_seconds - before.read_seconds
    return {
        "memory_gb": memory_gb,
        "io": io if memory_gb is not None else "resident",
        "policy": policy if memory_gb is not None else "",
        "tokens": len(out),
        "decode_tok_s": round((len(out) - 1) / seconds, 3),
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 1.0,
        "decode_bytes_read": nbytes,
        "decode_read_seconds": round(read_s, 3),
        "read_gbps": round(nbytes / read_s / 1e9, 3) if read_s else None,
        "read_share_of_decode": round(read_s / seconds, 3),
        "streamed_gbps_wall": round(nbytes / seconds / 1e9, 3),
        "cache_slots": after.cache_slots,
        "evictions": after.cache_evictions - before.cache_evictions,
        "worker_peak_rss_mb": peak,
        "token_ids_head": list(out[:8]),
        "iobench_adjacent_gbps": {qd: round((disk_before[qd] + disk_after[qd]) / 2, 3) for qd in disk_before},
    }


ADJACENT_QUEUE_DEPTHS = ("1", "8")  # one miss at a time, and the worker's 8 I/O threads


def adjacent_iobench(files: list[Path], record_size: int, io: str, seconds: float = 0.5) -> dict:
    return {qd: measure(files, record_size, io, int(qd), seconds)["gbps"] for qd in ADJACENT_QUEUE_DEPTHS}


def replay_policies(trace: Path, slots: int) -> dict:
    """Hit rate of each policy on the recorded calls, with the store's own slot logic."""
    calls = [
        (int(parts[0]), [int(e) for e in parts[1:]])
        for parts in (line.split() for line in trace.read_text().splitlines())
        if parts
    ]
    out = {}
    for name in ("lru", "lfu-decay"):
        policy, cached, hits, total = make_policy(name, slots), set(), 0, 0
        for layer, experts in calls:
            pinned = {(layer, e) for e in experts}
            for key in sorted(pinned, key=lambda k: k not in cached):  # hits first, as plan() orders
                total += 1
                if key in cached:
                    hits += 1
                elif len(cached) >= slots:
                    victim = policy.victim(pinned)
                    cached.discard(victim)
                    policy.forget(victim)
                cached.add(key)
                policy.touch(key)
        out[name] = round(hits / total, 4) if total else 0.0
    return {"calls": len(calls), "hit_rate": out}


def zipf_trace(path: Path, layers: int, experts: int, top_k: int, calls: int, skew: float = 1.0) -> Path:
    """A routing trace where expert popularity follows Zipf(skew), as real routers are skewed."""
    import random

    rng = random.Random(0)
    weights = [1.0 / (rank + 1) ** skew for rank in range(experts)]
    orders = [rng.sample(range(experts), experts) for _ in range(layers)]  # popularity per layer
    lines = []
    for _ in range(calls):
        for layer in range(layers):
            chosen: set[int] = set()
            while len(chosen) < top_k:
                chosen.add(orders[layer][rng.choices(range(experts), weights)[0]])
            lines.append(f"{layer} " + " ".join(map(str, sorted(chosen))))
    path.write_text("\n".join(lines))
    return path


def prefetch_bound(trace: Path, slots: int) -> dict:
    """Would "this layer's experts of the previous token" have prefetched the misses?"""
    previous: dict[int, set[int]] = {}
    predicted_misses = misses = predicted = 0
    policy, cached = make_policy("lru", slots), set()
    for line in trace.read_text().splitlines():
        parts = line.split()
        if not parts:
            continue
        layer, experts = int(parts[0]), [int(e) for e in parts[1:]]
        guess = previous.get(layer, set())
        pinned = {(layer, e) for e in experts}
        predicted += len([e for e in guess if (layer, e) not in cached])  # what a prefetch would read
        for key in pinned:
            if key not in cached:
                misses += 1
                predicted_misses += key[1] in guess
                if len(cached) >= slots:
                    victim = policy.victim(pinned)
                    cached.discard(victim)
                    policy.forget(victim)
                cached.add(key)
            policy.touch(key)
        previous[layer] = set(experts)
    return {
        "misses": misses,
        "misses_predicted": predicted_misses,
        "share_of_misses_predicted": round(predicted_misses / misses, 4) if misses else 0.0,
        "prefetch_reads_per_useful_read": round(predicted / predicted_misses, 2)
        if predicted_misses
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=6, help="MoE layers (6: 2.3 GB of experts)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--iobench-seconds", type=float, default=1.0)
    parser.add_argument("--keep-model", action="store_true", help="keep the bench split for the next run")
    parser.add_argument("--build-only", action="store_true", help="build the bench split and stop")
    args = parser.parse_args()
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")  # logs to stderr: stdout carries only the JSON
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints while quantizing
        split = bench_split(args.layers)
    if args.build_only:
        return
    manifest = Manifest.load(split)
    per_expert = expert_bytes(manifest.layers[0])
    experts_total = per_expert * manifest.num_experts * len(manifest.layers)
    log(f"{split}: {experts_total / 1e9:.2f} GB of experts, record {manifest.layers[0].record_size} bytes")

    log("iobench")
    disk = run_iobench(split, seconds=args.iobench_seconds)
    workdir = Path(tempfile.mkdtemp(prefix="mm-stream-", dir="/tmp"))
    runs = []
    try:
        trace = workdir / "trace-25.txt"
        for fraction in (0.25, 0.5):
            for io in ("direct", "buffered"):
                log(f"decode at {fraction:.0%} budget, {io}")
                run = decode_run(
                    split,
                    workdir,
                    args.tokens,
                    fraction * experts_total / 1e9,
                    io,
                    "lru",
                    trace=trace if (fraction, io) == (0.25, "direct") else None,
                )
                runs.append({"budget_fraction": fraction, **run})
        log("decode with every expert resident")
        runs.append(
            {"budget_fraction": 1.0, **decode_run(split, workdir, args.tokens, None, "direct", "lru")}
        )
        slots = runs[0]["cache_slots"]
        policies = replay_policies(trace, slots)
        top_k = QWEN3_30B_A3B_SHAPE["num_experts_per_tok"]
        skewed = zipf_trace(workdir / "zipf.txt", len(manifest.layers), manifest.num_experts, top_k, 400)
        policies_zipf = replay_policies(skewed, slots)
        # The better policy on the model's own trace; a tie goes to the better one on skewed routing.
        better = max(
            policies["hit_rate"], key=lambda n: (policies["hit_rate"][n], policies_zipf["hit_rate"][n])
        )
        if better != "lru":
            log(f"decode at 25% budget with {better}")
            run = decode_run(split, workdir, args.tokens, 0.25 * experts_total / 1e9, "direct", better)
            runs.append({"budget_fraction": 0.25, **run})
        prefetch = prefetch_bound(trace, slots)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if not args.keep_model:
            shutil.rmtree(split, ignore_errors=True)

    qd = "8"  # the worker's I/O threads: the most reads a call has in flight
    ratios = {}
    for run in runs:
        if run["read_gbps"]:
            ref = disk["gbps"][run["io"]]
            adjacent = max(run["iobench_adjacent_gbps"].values())
            ratios[f"{run['io']}@{run['budget_fraction']:.0%}/{run['policy']}"] = {
                "vs_adjacent_iobench_best_of_qd1_qd8": round(run["read_gbps"] / adjacent, 3),
                "vs_same_qd": round(run["read_gbps"] / ref[qd], 3),
                "vs_best_qd": round(run["read_gbps"] / disk["best"][run["io"]]["gbps"], 3),
            }
    lru_runs = [r for r in runs if r["policy"] == "lru" and r["read_gbps"]]
    io_means = {
        io: round(
            sum(r["read_gbps"] for r in lru_runs if r["io"] == io)
            / max(1, sum(r["io"] == io for r in lru_runs)),
            3,
        )
        for io in ("direct", "buffered")
    }
    result = {
        "bench": "stream",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "model": f"random qwen3_moe, Qwen3-30B-A3B MoE shape, {len(manifest.layers)} MoE layers, 4-bit (group 64)",
        "expert_bytes": experts_total,
        "record_size": manifest.layers[0].record_size,
        "tokens": args.tokens,
        "iobench": {"gbps": disk["gbps"], "best": disk["best"]},
        "decode": runs,
        "streamed_vs_iobench": {"queue_depth_compared": int(qd), **ratios},
        "policy_replay_25pct": policies,
        "policy_replay_25pct_zipf_synthetic": policies_zipf,
        "policy_kept": better,
        "io_mean_read_gbps": io_means,
        "io_default_by_measurement": max(io_means, key=io_means.get),
        "prefetch": {
            **prefetch,
            "read_share_of_decode_25pct_direct": runs[0]["read_share_of_decode"],
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
