"""Expert streaming: decode with a worker whose RAM holds 25/50/100 % of the experts, vs the disk.

    python bench/stream.py --keep-model       # builds the model once (~2.3 GB on disk), then measures
    python bench/stream.py --keep-model --rounds 2 --tokens 4 --probe-seconds 0.1   # quicker

One run measures, on the same files:
- decode through real processes (core + one expert worker over Unix sockets), with the worker's
  defaults at budgets of 25 % and 50 % of the expert bytes and at 100 % (every expert resident),
  plus the other I/O mode at 25 %: tok/s, hit rate, and the worker's
  read GB/s while it streamed (bytes read / time its reads took), in `--rounds` rounds of
  `--tokens` tokens;
- `iobench` probes of the same files before the first round and after every round: random
  whole-record reads at queue depth 1-32, cold (direct I/O, or the page cache dropped; a buffered
  decode has its files' pages dropped every 0.1 s too), in the worker's I/O mode, plus the same
  reads one at a time after a 20 ms idle gap (a decoding worker's cadence). Each round's read GB/s
  is divided by the mean of the probes right before and after it (the disk drifts from second to
  second) at queue depth 1, at the worker's thread count, at the best queue depth (the highest
  median over all of this run's probes) and paced; the JSON gives median, range and quartiles;
- the worker's read path (threads, segment size) on the 25 % run's own misses, every setting
  interleaved call by call (bench/stream_replay.py);
- the two cache policies replayed on the 25 % run's routing trace and on a Zipf-skewed one;
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
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stream_replay import prefetch_bound, replay_policies, replay_read_paths, zipf_trace
from bench.stream_rounds import PACED, PACED_GAP_S, QUEUE_DEPTHS, decode_rounds, spread
from bench.workdir import bench_workdir
from services.common.manifest import Manifest
from services.experts.io import DEFAULT_IO_THREADS, DEFAULT_MIN_SEGMENT_BYTES
from services.experts.store_setup import DEFAULT_IO_MODE, DEFAULT_POLICY
from services.experts.streaming_store import expert_bytes
from services.ops.up import cache_root
from services.tools.synthetic_model import QWEN3_30B_A3B_SHAPE, build_random_checkpoint

TARGET = 0.8  # streamed GB/s during decode / iobench GB/s (the bar)
READ_PATHS = {  # name: (io threads, minimum segment bytes; 0 = whole records)
    "8 threads, whole records": (8, 0),
    "8 threads, segments >= 1 MiB": (8, 1 << 20),
    "8 threads, segments >= 512 KiB": (8, 512 << 10),
    "8 threads, segments >= 256 KiB": (8, 256 << 10),
    "4 threads, segments >= 512 KiB": (4, 512 << 10),
    "16 threads, segments >= 256 KiB": (16, 256 << 10),
}


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def bench_split(layers: int) -> Path:
    split = cache_root() / "bench" / f"stream-qwen3-30b-a3b-{layers}layer-q4-split"
    if not (split / "manifest.json").exists():
        from services.tools.split import split_checkpoint

        checkpoint = cache_root() / "bench" / f".stream-{layers}layer-checkpoint"
        log(f"building the {layers}-layer 4-bit model (once) in {checkpoint}")
        config = {**QWEN3_30B_A3B_SHAPE, "num_hidden_layers": layers}
        build_random_checkpoint(checkpoint, config, bits=4, group_size=64)
        split_checkpoint(checkpoint, split, progress=False)
        shutil.rmtree(checkpoint)  # only the split is needed from here on
    return split


def summarize(fraction: float, memory_gb: float | None, io: str, policy: str, run: dict) -> dict:
    """One decode configuration over its rounds."""
    rounds = run["rounds"]
    hits, misses = sum(r["hits"] for r in rounds), sum(r["misses"] for r in rounds)
    nbytes, read_s = sum(r["bytes"] for r in rounds), sum(r["read_seconds"] for r in rounds)
    seconds = sum(r["seconds"] for r in rounds)
    per_round_gbps = [r["bytes"] / r["read_seconds"] / 1e9 for r in rounds if r["read_seconds"]]
    return {
        "budget_fraction": fraction,
        "memory_gb": memory_gb,
        "io": io if memory_gb is not None else "resident",
        "policy": policy if memory_gb is not None else "",
        "rounds": len(rounds),
        "decode_tokens": sum(r["tokens"] - 1 for r in rounds),
        "decode_tok_s": spread([(r["tokens"] - 1) / r["seconds"] for r in rounds]),
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 1.0,
        "decode_bytes_read": nbytes,
        "decode_read_seconds": round(read_s, 3),
        "read_gbps": spread(per_round_gbps) if per_round_gbps else None,
        "read_gbps_pooled": round(nbytes / read_s / 1e9, 3) if read_s else None,
        "read_share_of_decode": round(read_s / seconds, 4),
        "streamed_gbps_wall": round(nbytes / seconds / 1e9, 4),
        "cache_slots": rounds[-1]["slots"],
        "evictions": sum(r["evictions"] for r in rounds),
        "worker_peak_rss_mb": run["worker_peak_rss_mb"],
        "bench_wall": run["wall"],
        "token_ids_head": rounds[0]["token_ids_head"],
    }


def round_ratios(run: dict, qd: str) -> list[float]:
    """Each round's read GB/s over the mean of its two adjacent probes at queue depth `qd`."""
    values = []
    for index, r in enumerate(run["rounds"]):
        if r["read_seconds"]:
            before, after = run["probes"][index][qd], run["probes"][index + 1][qd]
            values.append(r["bytes"] / r["read_seconds"] / 1e9 / ((before + after) / 2))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=6, help="MoE layers (6: 2.3 GB of experts)")
    parser.add_argument("--rounds", type=int, default=7, help="decode rounds per configuration")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per decode round")
    parser.add_argument("--probe-seconds", type=float, default=0.25, help="per queue depth per probe")
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

    load_before = os.getloadavg()[0]  # this box is shared: say how busy it was
    workdir = bench_workdir("mm-stream-")
    runs: list[tuple[dict, dict]] = []  # (summary, raw rounds and probes)

    def decode(fraction: float, io: str, policy: str, **kwargs) -> None:
        memory_gb = fraction * experts_total / 1e9 if fraction < 1 else None
        log(f"decode at {fraction:.0%} budget, {io if memory_gb else 'resident'}, {policy}")
        raw = decode_rounds(
            split,
            workdir,
            tokens=args.tokens,
            memory_gb=memory_gb,
            io=io,
            policy=policy,
            probe_seconds=args.probe_seconds,
            **{"rounds": args.rounds, **kwargs},
        )
        runs.append((summarize(fraction, memory_gb, io, policy, raw), raw))

    try:
        trace = workdir / "trace-25.txt"
        # The worker's defaults at every budget, and the other I/O mode at 25 %. The policies are
        # compared on the 25 % run's own routing trace (hit rate is all a policy changes).
        decode(0.25, DEFAULT_IO_MODE, DEFAULT_POLICY, trace=trace)
        decode(0.5, DEFAULT_IO_MODE, DEFAULT_POLICY)
        decode(1.0, DEFAULT_IO_MODE, DEFAULT_POLICY, rounds=max(2, args.rounds // 3))
        other_io = next(mode for mode in ("direct", "buffered") if mode != DEFAULT_IO_MODE)
        decode(0.25, other_io, DEFAULT_POLICY)
        slots = runs[0][0]["cache_slots"]
        policies = replay_policies(trace, slots)
        top_k = QWEN3_30B_A3B_SHAPE["num_experts_per_tok"]
        skewed = zipf_trace(workdir / "zipf.txt", len(manifest.layers), manifest.num_experts, top_k, 400)
        policies_zipf = replay_policies(skewed, slots)
        # The better policy on the model's own trace; a tie goes to the better one on skewed routing.
        better = max(
            policies["hit_rate"], key=lambda n: (policies["hit_rate"][n], policies_zipf["hit_rate"][n])
        )
        log("read paths on the 25% run's misses")
        read_paths = replay_read_paths(split, trace, slots, DEFAULT_POLICY, READ_PATHS, mode=DEFAULT_IO_MODE)
        prefetch = prefetch_bound(trace, slots)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if not args.keep_model:
            shutil.rmtree(split, ignore_errors=True)

    # The best queue depth of each mode: the highest median over all of this run's probes.
    probes_by_mode: dict[str, dict[str, list[float]]] = {}
    for summary, raw in runs:
        for p in raw["probes"]:
            for qd, gbps in p.items():
                probes_by_mode.setdefault(summary["io"], {}).setdefault(qd, []).append(gbps)
    iobench = {mode: {qd: spread(v) for qd, v in by_qd.items()} for mode, by_qd in probes_by_mode.items()}
    best_qd = {
        mode: max((qd for qd in by_qd if qd != PACED), key=lambda qd: by_qd[qd]["median"])
        for mode, by_qd in iobench.items()
    }
    threads = str(DEFAULT_IO_THREADS)
    compared, pooled = {}, {}
    for summary, raw in runs:
        if summary["read_gbps"] is None:
            continue
        qds = {
            "vs_qd1": "1",
            f"vs_qd{threads}": threads,
            "vs_best_qd": best_qd[summary["io"]],
            "vs_qd1_paced": PACED,
        }
        per_round = {label: round_ratios(raw, qd) for label, qd in qds.items()}
        compared[f"{summary['io']}@{summary['budget_fraction']:.0%}/{summary['policy']}"] = {
            **{label: spread(values) for label, values in per_round.items()},
            # All rounds' bytes over all their read time, over the median of this run's own probes.
            "pooled": {
                label: round(summary["read_gbps_pooled"] / statistics.median(p[qd] for p in raw["probes"]), 3)
                for label, qd in qds.items()
            },
        }
        for label, values in per_round.items():
            pooled.setdefault(summary["io"], {}).setdefault(label, []).extend(values)
    # The I/O mode that streamed faster at 25 % with the default policy becomes (or stays) the default.
    at_quarter = {
        s["io"]: s["read_gbps"]["median"]
        for s, _ in runs
        if s["budget_fraction"] == 0.25 and s["policy"] == DEFAULT_POLICY and s["read_gbps"]
    }
    faster_io = max(at_quarter, key=at_quarter.get)
    headline = spread(pooled[DEFAULT_IO_MODE]["vs_best_qd"])
    result = {
        "bench": "stream",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_1min": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},
        "model": f"random qwen3_moe, Qwen3-30B-A3B MoE shape, {len(manifest.layers)} MoE layers, 4-bit (group 64)",
        "expert_bytes": experts_total,
        "record_size": manifest.layers[0].record_size,
        "rounds": args.rounds,
        "tokens_per_round": args.tokens,
        "worker_read_path": {
            "io_threads": DEFAULT_IO_THREADS,
            "min_segment_kb": DEFAULT_MIN_SEGMENT_BYTES >> 10,
        },
        "iobench_probes_gbps": iobench,
        "iobench_best_queue_depth": {mode: int(qd) for mode, qd in best_qd.items()},
        "decode": [summary for summary, _ in runs],
        "streamed_vs_iobench": compared,
        "streamed_vs_iobench_all_rounds": {
            io: {label: spread(values) for label, values in by_label.items()}
            for io, by_label in pooled.items()
        },
        "target": {
            "ratio": TARGET,
            "io": DEFAULT_IO_MODE,
            "all_rounds_vs_best_qd": headline,
            "met_by_median": headline["median"] >= TARGET,
        },
        "read_path_replay_25pct_direct": read_paths,
        "policy_replay_25pct": policies,
        "policy_replay_25pct_zipf_synthetic": policies_zipf,
        "policy_kept": better,
        "read_gbps_at_25pct_by_io": at_quarter,
        "io_default_by_measurement": faster_io,
        "prefetch": {
            **prefetch,
            "read_share_of_decode_25pct_direct": runs[0][0]["read_share_of_decode"],
        },
        "queue_depths_probed": list(QUEUE_DEPTHS),
        "paced_probe": f"queue depth 1, {PACED_GAP_S * 1000:.0f} ms idle before each read",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
