"""`moe-mesh iobench PATH` and `moe-mesh plan`: a disk's random-read speed at a split's record
size, and where a model's bytes will live before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.cli_types import non_negative_float, positive_float, positive_int
from services.experts.cli_flags import queue_depths
from services.ops.cluster import CoreConfig


def add_storage_commands(sub) -> None:
    """`moe-mesh iobench PATH` and `moe-mesh plan --model M --memory-gb X`."""
    p = sub.add_parser("iobench", help="this disk's random-read GB/s at a split's expert record size")
    p.add_argument("path", help="a split folder (its layer files and record size) or any large file")
    p.add_argument(
        "--record-size", type=positive_int, default=None, help="bytes per read (default: the split's)"
    )
    p.add_argument(
        "--queue-depths",
        type=queue_depths,
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
    p.add_argument(
        "--image-cache-gb",
        type=non_negative_float,
        default=1.0,
        help="core's budget for vision-tower outputs kept by image (models that take images)",
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
        image_cache_gb=args.image_cache_gb,
        mlx_cache_gb=args.mlx_cache_gb,
    )
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
