"""Where one expert layer call's time goes, part by part, for a one-token decode step.

    python bench/layer_call.py [--model qwen3-30b-a3b-4layer|demo|PATH] [--dtype float32] [--calls 500]
        [--worker-only]

Prints one JSON object with p50/p99 microseconds of:
  in_graph_compute         the layer's expert module on device-resident inputs (what monolithic pays)
  worker_compute_steps     the worker's compute built up one step at a time (compute_steps)
  host_round_trip          hidden to host bytes and [k, H] back into an MLX array (no network)
  worker_run               ExpertCompute.run on a wire message: decode, validate, compute, encode
  worker_parts_back_to_back  that call's own timers (decode + checks, compute, reply encoding),
  worker_parts_after_compute calls back to back, and each right after the experts ran in-graph
                           (caches cold, as after core's turn in a decode step)
  dispatcher_call          the real thing: core's dispatcher -> worker process -> back (over the
                           worker's frame socket, as core does on one host)
  dispatcher_worker_side   the worker's own decode + compute + encode within that call
  dispatcher_transport     the rest: everything between core's proxy and the worker's compute
  dispatcher_call_grpc,    the same, to the same worker, over its gRPC stream only
  dispatcher_transport_grpc  (core --no-expert-frames)
  grpc_echo_idle           the floor: the same Forward round trip (same payload bytes, same client
                           pattern, on the dispatcher's own I/O loop) to a process that does no math
  grpc_echo_after_compute  that floor when the echo first stays busy (on the CPU, GIL released) as
                           long as the worker's side of a real call takes (median of the last 100
                           of 150 warm-up calls; threads asleep meanwhile wake slower), busy time subtracted
and transport_above_floor_p50_us = dispatcher_transport p50 - grpc_echo_after_compute p50: what
moe-mesh's own code adds to what gRPC in Python costs on this machine. The dispatchers and the two
echoes run in interleaved blocks, so a change in machine load hits them all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import checkpoint
from bench.grpc_echo import EchoLink, start_echo_server
from bench.timing import percentiles, timed
from bench.workdir import bench_workdir
from services.common import host_staging, tensor_codec
from services.common.manifest import Manifest
from services.core.expert_link.dispatcher import ExpertDispatcher
from services.experts.compute import ExpertCompute
from services.experts.store import ResidentExpertStore
from services.ops.up import resolve_split
from services.proto.moemesh.v1 import expert_pb2
from tests.helpers import linked_dispatcher


def interleaved(variants: dict, calls: int, block: int = 25, warmup: int = 20) -> dict[str, list[float]]:
    """{name: (busy_s, fn)} -> {name: microseconds per call, busy_s subtracted}, run in turns of
    `block` calls each until every variant made `calls`."""
    for _, fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    while len(samples[next(iter(variants))]) < calls:
        for name, (busy_s, fn) in variants.items():
            for _ in range(min(block, calls - len(samples[name]))):
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start - busy_s) * 1e6)
    return samples


def compute_steps(compute: ExpertCompute, layer: int, hidden: mx.array, ids: mx.array, calls: int) -> dict:
    """A worker's compute, one step added at a time (p50/p99 us each): the module on device inputs,
    compiled, then with inputs made from host bytes, then with the output read back to the host,
    then ExpertCompute.compute_rows itself (store lookup and wire form included)."""
    module = compute.module(layer)
    compiled = mx.compile(module)
    host_hidden, host_ids = tensor_codec.numpy_view(hidden), np.asarray(ids)

    def host_inputs():
        return module(*tensor_codec.to_mlx_with_ids(host_hidden, host_ids))

    def host_both_ways():
        out = tensor_codec.wire_form(host_inputs())
        mx.eval(out)
        return np.asarray(out)

    def unstaged(step):
        def run():
            with host_staging.plain_arrays():
                return step()

        return run

    steps = {
        "device_inputs": timed(lambda: mx.eval(module(hidden, ids)), calls),
        "device_inputs_compiled": timed(lambda: mx.eval(compiled(hidden, ids)), calls),
        "host_inputs": timed(lambda: mx.eval(host_inputs()), calls),
        "host_inputs_host_output": timed(host_both_ways, calls),
        "compute_rows": timed(lambda: compute.compute_rows(layer, host_hidden, host_ids), calls),
    }
    if host_staging.staging() is not None:  # the same, each input a fresh array (MLX CUDA)
        steps["host_inputs_unstaged"] = timed(unstaged(lambda: mx.eval(host_inputs())), calls)
        steps["compute_rows_unstaged"] = timed(
            unstaged(lambda: compute.compute_rows(layer, host_hidden, host_ids)), calls
        )
    return steps


def main() -> None:
    from services.common.logging import configure_logging

    configure_logging("bench", "warning")  # logs to stderr: stdout carries only the JSON
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b-4layer")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--worker-only", action="store_true", help="stop after the in-process worker parts")
    args = parser.parse_args()

    split = resolve_split(str(checkpoint(args.model, args.dtype)))
    manifest = Manifest.load(split)
    layer = manifest.layers[0]
    k = manifest.experts_per_token
    dtype = tensor_codec.MLX_DTYPE_BY_NAME[manifest.dtype]
    compute = ExpertCompute(
        ResidentExpertStore(split, manifest, {layer.layer: list(range(layer.num_experts))})
    )
    module = compute._modules[layer.layer]
    rng = np.random.default_rng(0)
    hidden = mx.random.normal((1, manifest.hidden_size)).astype(dtype)
    ids = mx.array(rng.choice(layer.num_experts, size=(1, k), replace=False).astype(np.int32))
    mx.eval(hidden, ids)
    report: dict = {
        "bench": "layer_call",
        "model": args.model,
        "device": str(mx.default_device()),
        "hidden": manifest.hidden_size,
        "top_k": k,
        "dtype": manifest.dtype,
    }

    report["in_graph_compute"] = timed(lambda: mx.eval(module(hidden, ids)), args.calls)
    report["worker_compute_steps"] = compute_steps(compute, layer.layer, hidden, ids, args.calls)

    def host_round_trip():
        host = tensor_codec.numpy_view(hidden)  # what the dispatcher sends
        back = mx.array(np.repeat(host, k, axis=0))  # what comes back: [k, H]
        mx.eval(back)

    report["host_round_trip"] = timed(host_round_trip, args.calls)
    call = expert_pb2.ExpertCall(
        call_id=1, layer=layer.layer, hidden=tensor_codec.encode(hidden), expert_ids=tensor_codec.encode(ids)
    )
    report["worker_run"] = timed(lambda: compute.run(call), args.calls)

    def worker_parts(after_compute: bool) -> dict:
        parts: dict[str, list[float]] = {"decode_us": [], "compute_us": [], "encode_us": []}
        for _ in range(args.calls):
            if after_compute:
                mx.eval(module(hidden, ids))
            stats = compute.run(call).stats
            for name, samples in parts.items():
                samples.append(getattr(stats, name))
        return {name: percentiles(samples) for name, samples in parts.items()}

    report["worker_parts_back_to_back"] = worker_parts(after_compute=False)
    report["worker_parts_after_compute"] = worker_parts(after_compute=True)
    if args.worker_only:
        print(json.dumps(report, indent=1))
        return

    workdir = bench_workdir("mm-lc-")
    servers = []
    try:
        with linked_dispatcher(split, workdir, [f"0-{layer.num_experts - 1}"]) as (workers, dispatcher, _):
            # the same worker reached over its gRPC stream only (core --no-expert-frames)
            grpc_only = ExpertDispatcher(manifest, workers.addresses, frames=False)
            assert grpc_only.discover() == []
            # The echo stays busy as long as the worker's side of a real call takes, measured here.
            for _ in range(150):
                dispatcher.call(layer.layer, hidden, ids)
            compute_s = float(np.median(dispatcher.timings.snapshot()[-100:, 1])) / 1e6
            echo_busy = {"grpc_echo_idle": 0.0, "grpc_echo_after_compute": compute_s}
            echoes = {}
            for name, busy_s in echo_busy.items():
                address = f"unix:{workdir / name}.sock"
                servers.append(start_echo_server(address, busy_s, dict(os.environ)))
                echoes[name] = EchoLink(address, manifest.hidden_size, k, loop=dispatcher.loop)
            samples = interleaved(
                {
                    "dispatcher_call": (0.0, lambda: dispatcher.call(layer.layer, hidden, ids)),
                    "dispatcher_call_grpc": (0.0, lambda: grpc_only.call(layer.layer, hidden, ids)),
                    **{name: (echo_busy[name], echo.round_trip) for name, echo in echoes.items()},
                },
                args.calls,
            )
            calls = dispatcher.timings.snapshot()[-args.calls :]
            grpc_calls = grpc_only.timings.snapshot()[-args.calls :]
            grpc_only.close()
            for echo in echoes.values():
                echo.close()
    finally:
        for server in servers:
            server.kill()
            server.wait()
    report["dispatcher_call"] = percentiles(samples["dispatcher_call"])
    report["dispatcher_worker_side"] = percentiles(list(calls[:, 1]))
    report["dispatcher_transport"] = percentiles(list(calls[:, 0] - calls[:, 1]))
    report["dispatcher_call_grpc"] = percentiles(samples["dispatcher_call_grpc"])
    report["dispatcher_transport_grpc"] = percentiles(list(grpc_calls[:, 0] - grpc_calls[:, 1]))
    for name in echo_busy:
        report[name] = percentiles(samples[name])
    report["echo_busy_us"] = round(compute_s * 1e6, 1)
    report["transport_above_floor_p50_us"] = round(
        report["dispatcher_transport"]["p50_us"] - report["grpc_echo_after_compute"]["p50_us"], 1
    )
    # This box is shared: the load says how much the numbers can be trusted.
    report["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
