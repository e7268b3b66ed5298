"""`moe-mesh expert`: load a shard of the experts and serve ExpertWorker over gRPC."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import mlx.core as mx

from services.common.frames import frames_path_for
from services.common.grpc_util import (
    install_uvloop,
    refuse_insecure_bind,
    start_metrics_server,
    start_server,
    unix_socket_path,
)
from services.common.load_progress import load_stage_done
from services.common.logging import get_logger
from services.common.manifest import Manifest
from services.common.ranges import format_ranges, means_all, parse_ranges
from services.common.tls import TlsFiles
from services.common.unix_sockets import path_fits
from services.experts.compute import DEFAULT_MAX_CALL_BYTES, ExpertCompute
from services.experts.data_plane_worker import DataPlaneWorker
from services.experts.frame_server import FrameServer
from services.experts.io import DEFAULT_MIN_SEGMENT_BYTES
from services.experts.servicer import ExpertWorkerServicer
from services.experts.store_setup import DEFAULT_IO_MODE, DEFAULT_POLICY, open_store
from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc

log = get_logger(__name__)
SERVICE_NAME = expert_pb2.DESCRIPTOR.services_by_name["ExpertWorker"].full_name


def owned_experts(manifest: Manifest, layers: str | None, experts: str | None) -> dict[int, list[int]]:
    """(layer -> experts) this worker serves, from range strings ("all" by default: every MoE
    layer, wherever dense layers sit between them). Ranges that name a dense layer are refused."""
    layer_ids = set(manifest.layer_indices)
    chosen_layers = parse_ranges(layers, max(layer_ids) + 1, "--layers")
    unknown = [] if means_all(layers) else [layer for layer in chosen_layers if layer not in layer_ids]
    if unknown:
        raise ValueError(
            f"--layers: {format_ranges(unknown)} are not MoE layers (MoE layers: {format_ranges(sorted(layer_ids))})"
        )
    chosen_experts = parse_ranges(experts, manifest.num_experts, "--experts")
    return {layer: chosen_experts for layer in chosen_layers if layer in layer_ids}


async def serve_expert_worker(
    split_dir: Path,
    listen: str,
    layers: str | None = None,
    experts: str | None = None,
    worker_id: str | None = None,
    max_call_bytes: int = DEFAULT_MAX_CALL_BYTES,
    tls: TlsFiles | None = None,
    insecure: bool = False,
    metrics: str | None = None,
    memory_gb: float | None = None,
    io_mode: str = DEFAULT_IO_MODE,
    cache_policy: str = DEFAULT_POLICY,
    io_threads: int = 8,
    io_min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES,
    frame_spin_s: float = 0.0,
    expert_kernel: str = "auto",
    compute_threads: int | None = None,
    distributed: str | None = None,
) -> None:
    """`tls`: serve mTLS only (clients need a certificate from the cluster CA); `metrics`:
    host:port of the Prometheus endpoint (None = none); `distributed`: join core's in-graph data
    plane on this backend (services/experts/data_plane_worker.py)."""
    refuse_insecure_bind(listen, tls, insecure)  # before loading anything
    manifest = Manifest.load(split_dir)
    owned = owned_experts(manifest, layers, experts)
    worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
    log.info(
        "worker_loading", split=str(split_dir), layers=format_ranges(list(owned)), experts=experts or "all"
    )
    # `memory_gb`: keep at most that many GB of expert weights in RAM, stream the rest.
    store, budget_bytes = open_store(
        split_dir,
        manifest,
        owned,
        memory_gb,
        io_mode=io_mode,
        policy=cache_policy,
        io_threads=io_threads,
        min_segment_bytes=io_min_segment_bytes,
    )
    stats = store.stats()
    load_stage_done(
        "experts_mapped",
        layers=format_ranges(list(owned)),
        experts=experts or "all",
        resident_gb=round(stats.resident_bytes / 1e9, 3),
        streamed=budget_bytes > 0,
    )
    started = time.monotonic()
    compute = ExpertCompute(
        store, max_call_bytes=max_call_bytes, kernel=expert_kernel, threads=compute_threads
    )
    load_stage_done("kernels_ready", time.monotonic() - started, expert_kernel=compute.kernel_name)
    servicer = ExpertWorkerServicer(compute, worker_id, memory_budget_bytes=budget_bytes)

    running = await start_server(
        lambda server: expert_pb2_grpc.add_ExpertWorkerServicer_to_server(servicer, server),
        SERVICE_NAME,
        listen,
        max_message_bytes=max_call_bytes + (1 << 20),
        tls=tls,
        insecure=insecure,
    )
    # Same host: calls may also come as frames on a Unix socket beside the gRPC one.
    grpc_socket = unix_socket_path(running.address)
    frames = None
    if grpc_socket is not None and not path_fits(frames_path_for(str(grpc_socket))):
        # the frame path is a shortcut beside gRPC; a socket path with no room for ".frames" keeps gRPC only
        log.warning("frames_off", reason=f"{frames_path_for(str(grpc_socket))} is too long for a Unix socket")
    elif grpc_socket is not None:
        servicer.frames_path = frames_path_for(str(grpc_socket))
        frames = FrameServer(servicer.frames_path, servicer.answer, max_call_bytes + (1 << 20), frame_spin_s)
    if distributed is not None:
        servicer.data_plane = DataPlaneWorker(compute, distributed)  # joins when core asks
    start_metrics_server(metrics)
    log.info(
        "worker_serving",
        address=running.address,
        resident_bytes=store.stats().resident_bytes,
        worker_id=worker_id,
        expert_kernel=compute.kernel_name,
    )
    load_stage_done("serving", address=running.address, worker_id=worker_id)

    async def on_stop() -> None:
        if frames is not None:
            await asyncio.to_thread(frames.close)
        await asyncio.to_thread(servicer.close)
        stats = store.stats()
        log.info(
            "worker_stopping",
            calls=servicer.calls,
            rejected=servicer.rejected,
            cache_hits=stats.hits,
            cache_misses=stats.misses,
            bytes_read=stats.bytes_read,
            read_gbps=round(stats.read_gbps, 3),
        )

    # A Forward stream never ends by itself: let the call in flight finish (ms), then cancel the
    # streams; core fails over to a replica or reconnects when this worker is back.
    await running.serve_until_signal(on_stop, grace_s=1.0)


def run_expert_worker(mlx_cache_bytes: int | None = None, **kwargs) -> None:
    """`mlx_cache_bytes`: MLX's cache of freed buffers is held under this, so a worker's memory is
    its resident experts and this (what `moe-mesh plan` states)."""
    if mlx_cache_bytes is not None:
        mx.set_cache_limit(mlx_cache_bytes)
    install_uvloop()
    asyncio.run(serve_expert_worker(**kwargs))
