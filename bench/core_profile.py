"""Where a split decode token's time goes on core's engine thread: a py-spy profile.

    pip install py-spy && python bench/core_profile.py [--workers 1] [--tokens 160] [--seconds 20]
        [--model demo|qwen3-30b-a3b-4layer|PATH] [--dtype float32|bfloat16]

Starts N workers and core on the model (frame reads poll as `moe-mesh up` would choose),
decodes `--tokens` greedily through Core.Generate and samples the core process with py-spy
meanwhile. Reported, as shares of the engine thread's samples: waiting for the workers'
answers (frame reads, gRPC reply queue), core's own MLX evaluation (the evals in RemoteExperts
and step_merge), and everything else (Python: graph building, dispatcher, engine), plus the
run's tok/s and layer-call p50s. `functions_pct` gives each function's inclusive share of the
engine thread's samples (the largest 40), so the Python share can be traced to its callers.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import linecache
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import PROMPT, spin_as_up, split_system, timed_decode
from bench.models import checkpoint
from bench.workdir import bench_workdir
from services.ops.up import resolve_split

# frames that wait for the workers' answers; source lines that make MLX compute
WAITING = ("receive_exact", "_poll_into", "SimpleQueue.get")
EVALUATING = ("mx.eval(", "async_eval(", ".tolist()", ".item()", "np.asarray(", "np.array(")


def classify(stack: list[str]) -> str:
    if any(name in frame for frame in stack for name in WAITING):
        return "waiting_for_workers"
    # MLX computes without Python frames: a sample whose innermost line evaluates is MLX time
    where = stack[-1].rsplit("(", 1)[-1].rstrip(")")
    filename, _, line = where.rpartition(":")
    source = linecache.getline(filename, int(line)) if line.isdigit() else ""
    return "core_mlx_eval" if any(call in source for call in EVALUATING) else "python"


def function_name(frame: str) -> str:
    """py-spy's `function (path/file.py:line)` as `file.py:function`."""
    name, _, where = frame.partition(" (")
    return f"{Path(where.rsplit(':', 1)[0]).name}:{name}"


def main() -> None:
    import mlx_lm

    from services.common.logging import configure_logging

    configure_logging("bench", "warning")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--core-flag", action="append", default=[], help="extra `moe-mesh core` flag")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="float32", help="synthetic model's dtype (bfloat16 on GPUs)")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy")
    path = checkpoint(args.model, args.dtype)
    split = resolve_split(str(path))
    if args.model == "demo":
        prompt = mlx_lm.load(str(path), lazy=True)[1].encode(PROMPT)
    else:
        prompt = list(range(1000, 1024))
    workdir = bench_workdir("mm-prof-")
    profile = workdir / "profile.txt"
    spin_us = spin_as_up(args.workers)
    with split_system(split, workdir, args.workers, spin_us, args.core_flag) as (address, core):
        timed_decode(address, prompt, 8)  # warm-up
        run: dict = {}
        decoding = threading.Thread(target=lambda: run.update(r=timed_decode(address, prompt, args.tokens)))
        decoding.start()
        time.sleep(2)
        record = [
            py_spy,
            "record",
            "-p",
            str(core.pid),
            "-d",
            str(args.seconds),
            "-r",
            "200",
            "--full-filenames",
        ]
        subprocess.run(
            [*record, "-f", "raw", "-o", str(profile), "--nonblocking"], capture_output=True, check=True
        )
        decoding.join()
    shares: Counter = Counter()
    functions: Counter = Counter()
    for line in profile.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if any("engine.py" in frame for frame in frames):
            shares[classify(frames)] += int(count)
            for name in {function_name(frame) for frame in frames}:
                functions[name] += int(count)
    total = sum(shares.values())
    _, stamps, calls = run["r"]
    print(
        json.dumps(
            {
                "bench": "core_profile",
                "machine": f"{platform.system()} {platform.machine()}, mlx {mx.__version__} on {mx.default_device()}",
                "model": args.model,
                "dtype": args.dtype,
                "decode_tokens": args.tokens,
                "workers": args.workers,
                "core_flags": args.core_flag,
                "tok_s": round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 3),
                "layer_call_p50_us": {
                    "total": round(calls.total_p50_us, 1),
                    "compute": round(calls.compute_p50_us, 1),
                    "transport": round(calls.transport_p50_us, 1),
                },
                "engine_thread_samples": total,
                "share_pct": {name: round(100 * n / total, 1) for name, n in shares.most_common()},
                "functions_pct": {name: round(100 * n / total, 1) for name, n in functions.most_common(40)},
            }
        )
    )


if __name__ == "__main__":
    main()
