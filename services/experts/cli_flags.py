"""Command-line pieces of expert streaming and compute: the worker's flags."""

from __future__ import annotations

import argparse

from metal.experts_cpu import KERNELS
from services.common.cli_types import non_negative_float, non_negative_int, positive_float, positive_int
from services.experts.cache_policy import POLICIES
from services.experts.io import DEFAULT_IO_THREADS, DEFAULT_MIN_SEGMENT_BYTES, IO_MODES
from services.experts.store_setup import DEFAULT_IO_MODE, DEFAULT_POLICY

WORKER_MLX_CACHE_GB = 1.0  # freed MLX buffers a worker keeps for reuse (`moe-mesh plan` counts it)


def queue_depths(text: str) -> list[int]:
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
    parser.add_argument(
        "--mlx-cache-gb",
        type=non_negative_float,
        default=WORKER_MLX_CACHE_GB,
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
