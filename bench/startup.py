"""Seconds from spawning a service process to SERVING, and where they go.

    python bench/startup.py [--model demo|qwen3-30b-a3b-4layer|PATH] [--dtype bfloat16] [--rounds 2]

Per round, on the model's split (the demo model, bench/decode.py's synthetic shapes, or a checkpoint): one expert
worker holding every expert, a core over it, and a core with every expert in its own process
(`--worker local`), each a real process on a Unix socket, each timed from spawn to its gRPC health
check answering SERVING. The first round of a fresh machine pays one-off costs (the fused kernels'
self-check, compiling GPU kernels); later rounds show what every start pays.

Each service's phases come from its own log: `imports` is spawn to its first log line (the
interpreter, MLX and the project's modules); every logged event with a `seconds` field
(model load, grammar vocabulary, kernels) is listed with it; `rest` is what no event accounts
for. Also timed alone: an interpreter that imports MLX and evaluates one array on the default
device. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.models import checkpoint
from bench.workdir import bench_workdir
from services.common.manifest import Manifest
from services.ops.up import resolve_split
from tests.helpers import core_args, spawn, stop, wait_serving


def log(message: str) -> None:
    print(f"[startup] {message}", file=sys.stderr, flush=True)


def mlx_import_s() -> float:
    """An interpreter's start, `import mlx.core` and one evaluated array on the default device."""
    started = time.monotonic()
    code = "import mlx.core as mx; mx.eval(mx.ones(4) + 1)"
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - started


def log_phases(log_path: Path, spawned_at: float, serving_s: float) -> dict:
    """`imports` (spawn to the first log line), each event that logged its `seconds`, and `rest`."""
    events = []
    for line in log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "timestamp" in record:
            stamp = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
            events.append((stamp - spawned_at, record))
    phases: dict[str, float] = {}
    if events:
        phases["imports"] = round(events[0][0], 2)
    for _, record in events:
        # `load` progress stages (weights_read, kernels_ready) span the events timed above
        if isinstance(record.get("seconds"), (int, float)) and record["event"] != "load":
            name = record["event"]
            phases[name] = round(phases.get(name, 0.0) + record["seconds"], 2)
    phases["rest"] = round(serving_s - sum(phases.values()), 2)
    return phases


def start_timed(args: list[str], address: str, log_path: Path) -> tuple[subprocess.Popen, dict]:
    spawned_at = time.time()
    started = time.monotonic()
    proc = spawn(args, log_path)
    wait_serving(address, proc, timeout_s=600, log_path=log_path)
    serving_s = time.monotonic() - started
    return proc, {"serving_s": round(serving_s, 2), "phases": log_phases(log_path, spawned_at, serving_s)}


def one_round(split: Path, workdir: Path, index: int) -> dict:
    experts = Manifest.load(split).num_experts
    worker_address = f"unix:{workdir / f'w{index}.sock'}"
    worker_args = [
        "expert",
        "--split",
        str(split),
        "--listen",
        worker_address,
        "--experts",
        f"0-{experts - 1}",
    ]
    worker, worker_times = start_timed(worker_args, worker_address, workdir / f"w{index}.log")
    log(f"round {index}: worker serving after {worker_times['serving_s']} s")
    try:
        core_address = f"unix:{workdir / f'core{index}.sock'}"
        args = core_args(split, core_address, [worker_address])
        core, core_times = start_timed(args, core_address, workdir / f"core{index}.log")
        stop([core])
        log(f"round {index}: core serving after {core_times['serving_s']} s")
    finally:
        stop([worker])
    local_address = f"unix:{workdir / f'local{index}.sock'}"
    args = core_args(split, local_address, ["local"])
    local, local_times = start_timed(args, local_address, workdir / f"local{index}.log")
    stop([local])
    log(f"round {index}: core with local experts serving after {local_times['serving_s']} s")
    return {"worker": worker_times, "core": core_times, "core_local_experts": local_times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, a synthetic shape or a checkpoint")
    parser.add_argument("--dtype", default="bfloat16", help="a synthetic shape's dtype")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--logs", type=Path, help="copy the services' logs here")
    args = parser.parse_args()
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")  # logs to stderr: stdout carries only the JSON
    started = time.monotonic()
    split = resolve_split(str(checkpoint(args.model, args.dtype)))
    prepare_s = time.monotonic() - started
    rounds = []
    workdir = bench_workdir("mm-start-")
    for index in range(args.rounds):
        rounds.append(one_round(split, workdir, index))
    if args.logs:
        shutil.copytree(workdir, args.logs, ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
    later = rounds[1:] or rounds
    out = {
        "bench": "startup",
        "machine": f"{platform.system()} {platform.machine()}, mlx {mx.__version__} on {mx.default_device()}",
        "model": args.model,
        "model_build_and_split_s": round(prepare_s, 2),
        "mlx_import_and_first_eval_s": round(mlx_import_s(), 2),
        "rounds": rounds,
        "serving_s_after_first_round": {
            name: max(r[name]["serving_s"] for r in later)
            for name in ("worker", "core", "core_local_experts")
        },
        "command": "python bench/startup.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
