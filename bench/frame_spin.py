"""Polling vs sleeping frame reads (`--frame-spin-us`), A/B in one run on the demo model.

    python bench/frame_spin.py [--workers 1] [--rounds 4] [--tokens 64]
    python bench/frame_spin.py --model qwen3-30b-a3b-4layer --dtype bfloat16   # e.g. on a GPU host

Core and N workers as real processes on Unix sockets, both polling for up to 10 ms or both
sleeping in recv, interleaved round by round so that drift in machine speed hits both alike.
Per round: decode tok/s and core's per-layer-call transport and worker compute p50 (decode
steps only). Polling pays off only where every process has a core of its own, which is the
rule `moe-mesh up` applies (services.common.frames.spin_for). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import PROMPT, checkpoint, timed_decode
from services.common.manifest import Manifest
from services.up import expert_ranges, resolve_split
from tests.helpers import Workers, spawn, stop, wait_serving

VARIANTS = {"sleep": 0, "poll_10ms": 10_000}


def one_run(split: Path, prompt: list[int], workers: int, spin_us: int, tokens: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="mm-spin-", dir="/tmp"))
    manifest = Manifest.load(split)
    args = ["--frame-spin-us", str(spin_us)]
    pool = Workers(split, workdir, expert_ranges(manifest.num_experts, workers), extra_args=args).start()
    address = f"unix:{workdir / 'core.sock'}"
    core = spawn(
        ["core", "--split", str(split), "--listen", address, "--worker", ",".join(pool.addresses), *args],
        workdir / "core.log",
    )
    try:
        wait_serving(address, core, timeout_s=600, log_path=workdir / "core.log")
        _, stamps, calls = timed_decode(address, prompt, tokens)
    finally:
        stop([core])
        pool.stop()
    return {
        "tok_s": round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 3),
        "transport_p50_us": round(calls.transport_p50_us, 1),
        "compute_p50_us": round(calls.compute_p50_us, 1),
    }


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="demo", choices=["demo", "qwen3-30b-a3b-4layer"])
    parser.add_argument("--dtype", default="float32", help="the synthetic model's dtype")
    args = parser.parse_args()
    path = checkpoint(args.model, args.dtype)
    split = resolve_split(str(path))
    if args.model == "demo":
        _, tokenizer = mlx_lm.load(str(path), lazy=True)
        prompt = tokenizer.encode(PROMPT)
    else:  # random weights: the prompt's length is what counts
        prompt = list(range(1000, 1024))
    rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for index in range(args.rounds):
        for name, spin_us in VARIANTS.items():
            rounds[name].append(one_run(split, prompt, args.workers, spin_us, args.tokens))
            print(json.dumps({"round": index + 1, name: rounds[name][-1]}), file=sys.stderr, flush=True)
    summary = {name: {key: median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    print(
        json.dumps(
            {
                "bench": "frame_spin",
                "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {mx.default_device()}",
                "model": args.model,
                "workers": args.workers,
                "decode_tokens": args.tokens,
                "median_of_rounds": summary,
                "rounds": rounds,
                "command": "python bench/frame_spin.py " + " ".join(sys.argv[1:]),
            }
        )
    )


if __name__ == "__main__":
    main()
