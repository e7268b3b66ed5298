"""Command-line pieces of expert streaming: worker flags and the `iobench` / `plan` commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from metal.experts_cpu import KERNELS
from services.common.cli_types import non_negative_float, non_negative_int, positive_float, positive_int
from services.experts.cache_policy import POLICIES
from services.experts.io import DEFAULT_IO_THREADS, DEFAULT_MIN_SEGMENT_BYTES, IO_MODES
from services.experts.store_setup import DEFAULT_IO_MODE, DEFAULT_POLICY


def _queue_depths(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",") if part.strip()]


def add_streaming_flags(parser: argparse.ArgumentParser) -> None:
    """`moe-mesh expert` flags: --memory-gb, --io, --cache-policy, --io-threads, --io-segment-kb."""
    parser.add_argument(
        "--memory-gb",
        type=positive_float,
        default=None,
        help="keep at most this many GB of expert weights in RAM and read the rest from the layer "
        "files on demand (default: all resident)",
    )
    parser.add_argument(
        "--io",
        choices=IO_MODES,
        default=DEFAULT_IO_MODE,
        help="reads of streamed experts: direct I/O or page cache",
    )
    parser.add_argument(
        "--cache-policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help="which experts a worker under --memory-gb keeps in RAM",
    )
    parser.add_argument(
        "--io-threads", type=positive_int, default=DEFAULT_IO_THREADS, help="parallel reads (queue depth)"
    )
    parser.add_argument(
        "--io-segment-kb",
        type=non_negative_int,
        default=DEFAULT_MIN_SEGMENT_BYTES // 1024,
        help="cut each expert record into reads of at least this many KiB, read in parallel, so a "
        "call that misses few experts still keeps --io-threads reads in flight (default 0: whole "
        "records; bench/stream.py measures whether your disk gains)",
    )


def add_compute_flags(parser: argparse.ArgumentParser) -> None:
    """`moe-mesh expert` flags: --expert-kernel, --compute-threads, --mlx-cache-gb."""
    parser.add_argument(
        "--expert-kernel",
        choices=KERNELS,
        default="auto",
        help="auto: where MLX computes on the CPU, quantized SwitchGLU layers (2/4/8-bit) run on "
        "moe-mesh's CPU kernel (metal/experts_cpu.c), the rest on mlx-lm's modules; mlx: mlx-lm's "
        "modules always",
    )
    parser.add_argument(
        "--compute-threads",
        type=positive_int,
        default=None,
        help="threads the CPU kernel may use for a large call (prefill); one-token calls use one "
        "(default: the CPUs this process may run on)",
    )
    from services.ops.cluster import CoreConfig

    parser.add_argument(
        "--mlx-cache-gb",
        type=non_negative_float,
        default=CoreConfig.mlx_cache_gb,
        help="GiB of freed MLX buffers this worker keeps for reuse (streamed experts come and go)",
    )


def compute_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        expert_kernel=args.expert_kernel,
        compute_threads=args.compute_threads,
        mlx_cache_bytes=int(args.mlx_cache_gb * (1 << 30)),
    )


def streaming_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        memory_gb=args.memory_gb,
        io_mode=args.io,
        cache_policy=args.cache_policy,
        io_threads=args.io_threads,
        io_min_segment_bytes=args.io_segment_kb * 1024,
    )


def add_storage_commands(sub) -> None:
    """`moe-mesh iobench PATH` and `moe-mesh plan --model M --memory-gb X`."""
    p = sub.add_parser("iobench", help="this disk's random-read GB/s at a split's expert record size")
    p.add_argument("path", help="a split folder (its layer files and record size) or any large file")
    p.add_argument(
        "--record-size", type=positive_int, default=None, help="bytes per read (default: the split's)"
    )
    p.add_argument(
        "--queue-depths",
        type=_queue_depths,
        default=[1, 2, 4, 8, 16, 32],
        help="comma-separated thread counts (default 1,2,4,8,16,32)",
    )
    p.add_argument("--modes", default="direct,buffered", help="comma-separated: direct, buffered")
    p.add_argument("--seconds", type=positive_float, default=1.0, help="time per (mode, queue depth)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_iobench)

    p = sub.add_parser("plan", help="print the memory plan of a model before anything loads")
    p.add_argument("--model", required=True, help="split folder or mlx-lm checkpoint folder")
    p.add_argument("--memory-gb", type=positive_float, required=True, help="expert RAM budget per worker")
    p.add_argument("--workers", type=positive_int, default=1, help="expert workers sharing the experts")
    p.add_argument("--context", type=positive_int, default=4096, help="tokens of context per sequence")
    p.add_argument("--seqs", type=positive_int, default=1, help="concurrent sequences")
    p.add_argument("--kv-bytes", type=positive_float, default=2.0, help="bytes per KV element (2 = fp16)")
    from services.ops.cluster import CoreConfig

    p.add_argument(
        "--prefix-cache-gb",
        type=non_negative_float,
        default=CoreConfig.prefix_cache_gb,
        help="core's prefix-cache budget",
    )
    p.add_argument(
        "--mlx-cache-gb",
        type=non_negative_float,
        default=CoreConfig.mlx_cache_gb,
        help="MLX buffer-cache limit of core and of each worker",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plan)


def _iobench(args) -> None:
    from services.experts.iobench import format_table, run_iobench

    result = run_iobench(
        Path(args.path),
        record_size=args.record_size,
        queue_depths=args.queue_depths,
        modes=[m for m in args.modes.split(",") if m],
        seconds=args.seconds,
    )
    print(json.dumps(result) if args.json else format_table(result))


def _plan(args) -> None:
    from services.ops.plan import format_plan, memory_plan

    plan = memory_plan(
        Path(args.model),
        memory_gb=args.memory_gb,
        workers=args.workers,
        context=args.context,
        seqs=args.seqs,
        kv_element_bytes=args.kv_bytes,
        prefix_cache_gb=args.prefix_cache_gb,
        mlx_cache_gb=args.mlx_cache_gb,
    )
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
