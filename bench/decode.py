"""Decode speed: monolithic mlx-lm vs moe-mesh (core + 1 and 2 expert workers), one run.

    python bench/decode.py                       # demo model and the Qwen3-30B-A3B-shaped model
    python bench/decode.py --models demo --tokens 64
    python bench/decode.py --layers 4,48 --dtype bfloat16 --tokens 128 \
        --variants synced_local,local_experts,workers_1   # on a GPU: the shapes the targets name

Prints one JSON object. A third variant, `synced_local`, is mlx-lm's model with its own expert
modules in-process but synchronised once per layer the way moe-mesh must: monolithic vs
synced_local is the price of the per-layer sync, synced_local vs moe-mesh the price of the wire.
`kernel_local` is the same with the experts computed by the CPU kernel moe-mesh's workers use on
CPUs (metal/experts_cpu.c): kernel_local vs moe-mesh is the price of the wire for the same math;
`workers_N_mlx_experts` are moe-mesh runs whose workers compute with mlx-lm's modules
(`--expert-kernel mlx`), the like-for-like comparison with monolithic mlx-lm. For moe-mesh the core and workers are real processes linked
by Unix sockets and the tokens are read from Core.Generate over gRPC; per-layer
expert call percentiles come from core's own timings (Core.GetStats), taken over
the decode steps only (one token per step). Core sends layer calls through the workers'
frame sockets (the same-host data path); `workers_1_grpc` is the 1-worker run with
`--no-expert-frames` (gRPC streams only) and `workers_1_no_overlap` the 1-worker run with
`--expert-overlap off` (core waits for each layer's experts before building the next layer),
in the same rounds. `local_experts` is core alone with `--worker local`: the experts in core's own
process and graph (services/core/expert_link/local.py). `--variants` picks which run (monolithic
always does: every ratio is against it). Per token, `outside_layer_calls_ms` is the decode
token's time minus its layer calls' (p50 x MoE layers): core's own work around the hops. Frame reads poll before
they sleep when the machine has a core per process (`--frame-spin-us`, chosen as
`moe-mesh up` chooses it; recorded per variant). `workers_N_ring` and `workers_1_two_gpus_nccl`
carry the layer calls in-graph over MLX's distributed group instead (`--distributed`,
services/common/data_plane.py): their `layer_call` percentiles are empty, since core makes no
hop it could time.

Greedy tokens are compared with monolithic mlx-lm (`tokens_match_monolithic`) and with mlx-lm's
own BatchGenerator on one sequence (`tokens_match_mlx_lm_batched`), the engine path core drives.
`first_differences` says where each run parts from monolithic and how close the top two logits
were there, `mlx_lm_batched` among them. That BatchGenerator run is timed too (`mlx_lm_batched_tok_s`,
every round): mlx-lm's own server path at one sequence, the reference for core's engine, which
drives the same batch classes (`ratio_vs_mlx_lm_batched`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import grpc
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.models import checkpoint, log, synthetic_name
from bench.token_equality import batched_reference, first_differences
from bench.workdir import bench_workdir
from metal.experts_cpu import SwitchGLUKernel
from services.common.frames import spin_for
from services.common.manifest import Manifest
from services.common.model_build import expert_modules
from services.common.module_paths import replace_modules
from services.common.tensor_codec import numpy_view, to_mlx
from services.ops.gpu_sharing import mps_for_cluster
from services.ops.up import (
    data_plane_envs,
    expert_ranges,
    gpu_count,
    resolve_split,
    worker_compute_threads,
)
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import Workers, spawn, stop, wait_serving

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class SyncedLocalExperts(nn.Module):
    """mlx-lm's own expert module, run in-process but with moe-mesh's synchronisation pattern:
    evaluate hidden states and ids, compute the experts, evaluate the result. Comparing this
    variant with monolithic isolates the price of syncing once per layer from the wire's."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._inner = inner

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        hidden, ids = x.reshape(-1, x.shape[-1]), indices.reshape(-1, indices.shape[-1]).astype(mx.int32)
        mx.eval(hidden, ids)
        out = self._inner(hidden, ids)
        mx.eval(out)
        return out.reshape(*indices.shape, x.shape[-1])


class KernelLocalExperts(nn.Module):
    """The expert module computed in-process by the CPU kernel moe-mesh's workers use
    (metal/experts_cpu.c), synchronised per layer as it must be: monolithic vs kernel_local is
    what the kernel alone gives, kernel_local vs moe-mesh the price of the wire."""

    def __init__(self, inner: nn.Module, kernel):
        super().__init__()
        self._inner, self._kernel = inner, kernel

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        hidden, ids = x.reshape(-1, x.shape[-1]), indices.reshape(-1, indices.shape[-1]).astype(mx.int32)
        mx.eval(hidden, ids)
        host, rows = numpy_view(hidden), np.asarray(ids)
        tokens = np.repeat(np.arange(rows.shape[0], dtype=np.int32), rows.shape[1])
        out = to_mlx(self._kernel(host, tokens, rows.ravel()))
        return out.reshape(*indices.shape, x.shape[-1])


def monolithic(path: Path, prompt: list[int], tokens: int, synced: str = "") -> tuple[float, list[int]]:
    """mlx-lm's generation; synced: "" (as is), "mlx" (SyncedLocalExperts), "kernel" (KernelLocalExperts;
    layers the kernel does not take stay as mlx-lm built them)."""
    model, _ = mlx_lm.load(str(path))
    if synced == "mlx":
        replace_modules(model, {p: SyncedLocalExperts(m) for p, m in expert_modules(model)})
    elif synced == "kernel":
        kernels = {p: (m, SwitchGLUKernel.for_module(m)) for p, m in expert_modules(model)}
        replace_modules(
            model, {p: KernelLocalExperts(m, k) for p, (m, k) in kernels.items() if k is not None}
        )
    out, stamps = [], []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=tokens):
        out.append(int(token))
        stamps.append(time.perf_counter())
    del model
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), out


def greedy_token_request(prompt: list[int], max_tokens: int) -> core_pb2.GenerateRequest:
    return core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=prompt),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def timed_decode(core_address: str, prompt: list[int], tokens: int) -> tuple[list[int], list[float], object]:
    """Greedy decode of `tokens` tokens from Core.Generate after a warm-up: (token ids, arrival
    times, core's LayerCallStats over the decode steps only)."""
    with grpc.insecure_channel(core_address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        request = greedy_token_request(prompt, 4)
        list(stub.Generate(request, timeout=600))  # warm-up
        request.stopping.max_tokens = tokens
        out, stamps = [], []
        for chunk in stub.Generate(request, timeout=3600):
            out.extend(chunk.token_ids)
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                stub.GetStats(core_pb2.GetStatsRequest(reset_layer_calls=True))  # keep decode steps only
        return out, stamps, stub.GetStats(core_pb2.GetStatsRequest()).layer_calls


# moe-mesh variants: name -> (workers, extra `moe-mesh core` flags, extra `moe-mesh expert` flags);
# 0 workers: every expert in core's process (`--worker local`).
SPLIT_VARIANTS = {
    "local_experts": (0, [], []),
    "workers_1": (1, [], []),
    "workers_1_unstaged": (1, [], []),  # host staging off (PROCESS_ENV): fresh arrays per call on CUDA
    "workers_1_no_mps": (1, [], []),  # no MPS daemon (NO_MPS), where `up` would start one
    "workers_1_two_gpus": (1, [], []),  # core on GPU 0, the worker on GPU 1 (GPU_PLACEMENT)
    "workers_2": (2, [], []),
    "workers_1_grpc": (1, ["--no-expert-frames"], []),
    "workers_1_no_overlap": (1, ["--expert-overlap", "off"], []),
    "workers_1_overlap": (1, ["--expert-overlap", "on"], []),  # off by default on GPUs
    "workers_1_mlx_experts": (1, [], ["--expert-kernel", "mlx"]),
    "workers_2_mlx_experts": (2, [], ["--expert-kernel", "mlx"]),
    # the in-graph data plane (services/common/data_plane.py) instead of frames
    "workers_1_ring": (1, ["--distributed", "ring"], ["--distributed", "ring"]),
    "workers_2_ring": (2, ["--distributed", "ring"], ["--distributed", "ring"]),
    "workers_1_two_gpus_nccl": (1, ["--distributed", "nccl"], ["--distributed", "nccl"]),
}


# Variants that place processes on GPUs of their own: name -> (core's env, each worker's env).
# They run only on a host with that many GPUs (`gpu_count`); the hop still crosses the host.
GPU_PLACEMENT = {
    "workers_1_two_gpus": ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}),
    "workers_1_two_gpus_nccl": ({}, {}),  # data_plane_envs puts rank r on GPU r
}
# Variants that differ only in their processes' environment: name -> (core's env, each worker's env).
PROCESS_ENV = {
    "workers_1_unstaged": ({"MOE_MESH_HOST_STAGING": "off"}, {"MOE_MESH_HOST_STAGING": "off"}),
}
# Variants run without the MPS daemon that `moe-mesh up` starts on NVIDIA GPUs (services/ops/gpu_sharing.py).
NO_MPS = {"workers_1_no_mps"}


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """os.environ with `values` set, for the processes spawned meanwhile."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spin_as_up(workers: int) -> int:
    """Microseconds frame reads poll, as `moe-mesh up` chooses for core plus `workers`."""
    return round(spin_for(workers + 1) * 1e6)


# seconds from spawn to SERVING of the last split_system's workers (all of them) and core
START_SECONDS: dict[str, float] = {}


@contextlib.contextmanager
def split_system(
    split: Path,
    workdir: Path,
    workers: int,
    spin_us: int,
    core_flags: list[str] = (),
    worker_flags: list[str] = (),
    placement: tuple[dict, dict] = ({}, {}),
    mps: str = "auto",
):
    """`workers` expert workers (experts divided between them) and a core, as real processes on
    Unix sockets in `workdir`, all reading frames with `spin_us` of polling; yields (core address,
    core process) once core serves, stops everything on exit. `placement`: (core's, the workers')
    extra environment, e.g. the GPU each sees; `mps`: NVIDIA's MPS daemon as `up --mps` runs it."""
    manifest = Manifest.load(split)
    spin = ["--frame-spin-us", str(spin_us)]
    ranges = expert_ranges(manifest.num_experts, workers) if workers else []
    threads = ["--compute-threads", str(worker_compute_threads(workers))]  # as `moe-mesh up` sets it
    # the data plane's group, as `moe-mesh up --distributed` forms it: core rank 0, workers 1..N
    flags = list(core_flags)
    backend = flags[flags.index("--distributed") + 1] if "--distributed" in flags else None
    envs = data_plane_envs(workdir, backend, workers + 1) if backend else [{}] * (workers + 1)
    daemon = mps_for_cluster(mps, workdir, workers + 1, gpu_count() if mps != "off" else 0)
    if daemon is not None:
        daemon.start()
        envs = [{**daemon.env, **env} for env in envs]
    started = time.monotonic()
    with environment(placement[1]):
        pool = Workers(
            split,
            workdir,
            ranges,
            tag=f"w{workers}-",
            extra_args=[*spin, *threads, *worker_flags],
            envs=envs[1:],
        ).start()
    START_SECONDS["workers"] = time.monotonic() - started if workers else 0.0
    address = f"unix:{workdir / f'core{workers}.sock'}"
    core_log = workdir / f"core{workers}.log"
    expert_addresses = ",".join(pool.addresses) or "local"
    core_args = ["core", "--split", str(split), "--listen", address, "--worker", expert_addresses]
    started = time.monotonic()
    with environment(placement[0]):
        core = spawn(core_args + spin + list(core_flags), core_log, envs[0])
    try:
        wait_serving(address, core, timeout_s=600, log_path=core_log)
        START_SECONDS["core"] = time.monotonic() - started
        yield address, core
    finally:
        stop([core])
        pool.stop()
        if daemon is not None:
            daemon.stop()


def split_run(
    split: Path,
    workdir: Path,
    workers: int,
    prompt: list[int],
    tokens: int,
    core_flags: list[str],
    worker_flags: list[str],
    placement: tuple[dict, dict] = ({}, {}),
    mps: str = "auto",
) -> dict:
    spin_us = spin_as_up(workers)
    system = split_system(split, workdir, workers, spin_us, core_flags, worker_flags, placement, mps)
    with system as (address, _):
        out, stamps, calls = timed_decode(address, prompt, tokens)
    layer = {
        field: round(getattr(calls, field), 1)
        for field in (
            "total_p50_us",
            "total_p99_us",
            "worker_p50_us",
            "worker_p99_us",
            "compute_p50_us",
            "compute_p99_us",
            "transport_p50_us",
            "transport_p99_us",
        )
    }
    layer["calls"] = calls.calls
    layer["part_p50_us"] = {name: round(value, 1) for name, value in sorted(calls.part_p50_us.items())}
    token_ms = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
    moe_layers = len(Manifest.load(split).layers) if workers else 0
    return {
        "tok_s": 1e3 / token_ms,
        "tokens": out,
        "layer_call": layer,
        "per_token_ms": round(token_ms, 3),
        "outside_layer_calls_ms": round(token_ms - moe_layers * calls.total_p50_us / 1e3, 3),
        "frame_spin_us": spin_us,
        "start_s": {name: round(seconds, 2) for name, seconds in START_SECONDS.items()},
    }


IN_PROCESS_VARIANTS = ("synced_local", "kernel_local")
VARIANTS = (*IN_PROCESS_VARIANTS, *SPLIT_VARIANTS)


def bench_model(name: str, tokens: int, rounds: int, dtype: str, variants: list[str]) -> dict:
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints while quantizing; stdout is the JSON
        path = checkpoint(name, dtype)
    split = resolve_split(str(path))
    if name == "demo":
        _, tokenizer = mlx_lm.load(str(path), lazy=True)
        prompt = tokenizer.encode(PROMPT)
    else:  # random weights: the prompt's meaning is irrelevant, its length is what counts
        prompt = list(range(1000, 1000 + 24))
    workdir = bench_workdir("mm-bench-")
    results: dict = {"monolithic": [], "mlx_lm_batched": [], **{variant: [] for variant in variants}}
    reference = None
    for round_index in range(rounds):  # interleaved, so drift in machine speed hits every variant alike
        step = f"{name}: round {round_index + 1}/{rounds}"
        log(f"{step} monolithic")
        tok_s, reference = monolithic(path, prompt, tokens)
        results["monolithic"].append(tok_s)
        log(f"{step} mlx-lm's BatchGenerator, one sequence")
        batched_tok_s, batched = batched_reference(path, prompt, tokens)
        results["mlx_lm_batched"].append(batched_tok_s)
        if "synced_local" in variants:
            log(f"{step} mlx-lm with experts synced per layer, in-process")
            results["synced_local"].append(monolithic(path, prompt, tokens, synced="mlx")[0])
        if "kernel_local" in variants:
            log(f"{step} mlx-lm with experts on moe-mesh's CPU kernel, in-process")
            tok_s, kernel_tokens = monolithic(path, prompt, tokens, synced="kernel")
            results["kernel_local"].append(
                {
                    "tok_s": tok_s,
                    "tokens": kernel_tokens,
                    "tokens_match_monolithic": kernel_tokens == reference,
                }
            )
        for variant in variants:
            if variant not in SPLIT_VARIANTS:
                continue
            workers, core_flags, worker_flags = SPLIT_VARIANTS[variant]
            placement = GPU_PLACEMENT.get(variant) or PROCESS_ENV.get(variant, ({}, {}))
            log(f"{step} moe-mesh {variant} {' '.join([*core_flags, *worker_flags])}")
            mps = "off" if variant in NO_MPS else "auto"
            run = split_run(split, workdir, workers, prompt, tokens, core_flags, worker_flags, placement, mps)
            run["tokens_match_monolithic"] = run["tokens"] == reference
            run["tokens_match_mlx_lm_batched"] = run["tokens"] == batched
            results[variant].append(run)
    mono = max(results["monolithic"])
    report = {
        "checkpoint": str(path),
        "decode_tokens": tokens,
        "monolithic_tok_s": round(mono, 3),
        "monolithic_per_token_ms": round(1e3 / mono, 3),
    }
    synced = max(results["synced_local"]) if "synced_local" in variants else None
    if synced is not None:
        report["synced_local_tok_s"] = round(synced, 3)
        report["synced_local_ratio_vs_monolithic"] = round(synced / mono, 3)
    kernel = None
    if "kernel_local" in variants:
        kernel = max(r["tok_s"] for r in results["kernel_local"])
        report["kernel_local_tok_s"] = round(kernel, 3)
        report["kernel_local_ratio_vs_monolithic"] = round(kernel / mono, 3)
        report["kernel_local_tokens_match_monolithic"] = all(
            r["tokens_match_monolithic"] for r in results["kernel_local"]
        )
    batched_best = max(results["mlx_lm_batched"])
    report["mlx_lm_batched_tok_s"] = round(batched_best, 3)
    report["mlx_lm_batched_ratio_vs_monolithic"] = round(batched_best / mono, 3)
    report["mlx_lm_batched_tokens_match_monolithic"] = batched == reference
    report["first_differences"] = first_differences(
        path,
        prompt,
        reference,
        {"mlx_lm_batched": batched, **{v: results[v][-1]["tokens"] for v in variants if v != "synced_local"}},
    )
    for key in (v for v in variants if v in SPLIT_VARIANTS):
        best = max(results[key], key=lambda r: r["tok_s"])
        entry = {"tok_s": round(best["tok_s"], 3), "ratio_vs_monolithic": round(best["tok_s"] / mono, 3)}
        for base_name, base in (
            ("synced_local", synced),
            ("kernel_local", kernel),
            ("mlx_lm_batched", batched_best),
        ):
            if base is not None:
                entry[f"ratio_vs_{base_name}"] = round(best["tok_s"] / base, 3)
        entry["tokens_match_monolithic"] = all(r["tokens_match_monolithic"] for r in results[key])
        entry["tokens_match_mlx_lm_batched"] = all(r["tokens_match_mlx_lm_batched"] for r in results[key])
        entry["start_s"] = [r["start_s"] for r in results[key]]  # each round's, the first one cold
        for field in ("per_token_ms", "outside_layer_calls_ms", "layer_call", "frame_spin_us"):
            entry[field] = best[field]
        report[key] = entry
    return report


def main() -> None:
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")  # logs to stderr: stdout carries only the JSON
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="demo,qwen3-30b-a3b-4layer",
        help="demo, qwen3-30b-a3b-<N>layer or a checkpoint path (comma-separated)",
    )
    parser.add_argument(
        "--layers",
        default=None,
        help="instead of --models: the Qwen3-30B-A3B shape with these layer counts, e.g. 4,48",
    )
    parser.add_argument(
        "--variants",
        default=",".join(v for v in VARIANTS if v not in GPU_PLACEMENT and v not in PROCESS_ENV),
        help=f"which to run beside monolithic mlx-lm (comma-separated): {', '.join(VARIANTS)}",
    )
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="synthetic model's float dtype (float32 on CPUs: GatherMM; bfloat16 on GPUs)",
    )
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    if any(v in GPU_PLACEMENT for v in variants) and gpu_count() < 2:
        parser.error(f"{', '.join(v for v in variants if v in GPU_PLACEMENT)} need a host with 2 GPUs")
    models = args.models.split(",")
    if args.layers:
        models = [synthetic_name(int(n)) for n in args.layers.split(",")]
    report = {
        "bench": "decode",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "note": "best of rounds; transport = core-side layer call time minus worker-side time, per call",
        "models": {
            name: bench_model(name, args.tokens, args.rounds, args.dtype, variants) for name in models
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
