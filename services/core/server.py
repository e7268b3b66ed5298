"""`moe-mesh core`: load core's part of the model, link to the expert workers, serve Core.

Health is NOT_SERVING until the model is loaded and every routed expert of every
MoE layer has a reachable worker with the same model fingerprint; it drops back to
NOT_SERVING when a worker goes away and returns when it is back.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path

from services.common.grpc_util import install_uvloop, refuse_insecure_bind, start_metrics_server, start_server
from services.common.load_progress import load_stage_done
from services.common.logging import get_logger
from services.common.manifest import Manifest
from services.common.model_shape import kv_bytes_per_token
from services.common.model_shape import text_config as model_text_config
from services.common.ranges import format_ranges
from services.common.tls import TlsFiles
from services.core.cluster_status import cluster_stats
from services.core.engine import Engine, EngineConfig
from services.core.expert_link.dispatcher import ExpertDispatcher, LayerCallTimings
from services.core.expert_link.distributed import DataPlane, DistributedExperts
from services.core.expert_link.local import LocalExperts
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.kv.factory import turboquant_unsupported_layers
from services.core.kv.kernel_select import kernel_backend
from services.core.model_loader import load_core_model, load_core_tokenizer
from services.core.request_prep import RequestPreparer
from services.core.servicer import CoreServicer
from services.core.speculative.mtp import check_mtp_servable, load_mtp
from services.core.stats_line import log_stats_lines
from services.core.structured_output import GrammarError
from services.core.vision.tower import VisionUnsupported, image_preparer, images_refused, load_vision
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

log = get_logger(__name__)
ENGINE_DIED = 71  # core's exit code when its engine thread died (a bug, logged as engine_thread_died)
SERVICE_NAME = core_pb2.DESCRIPTOR.services_by_name["Core"].full_name


def vocab_size_of(text_config: dict) -> int:
    """The model's vocabulary size, under the names mlx-lm's architectures give it."""
    for key in ("vocab_size", "num_vocab", "n_vocab", "padded_vocab_size"):
        if key in text_config:
            return int(text_config[key])
    raise ValueError("the model's config names no vocabulary size (vocab_size)")


def context_length_of(text_config: dict, max_model_len: int | None) -> int:
    """The context requests may fill: the model's (`max_position_embeddings`), or less where
    `--max-model-len` says so. Longer than the model's is refused: its positions were never trained."""
    model_len = int(text_config.get("max_position_embeddings") or 4096)
    if max_model_len is None:
        return model_len
    if max_model_len > model_len:
        raise ValueError(
            f"--max-model-len {max_model_len} is longer than the model's context "
            f"({model_len} tokens, max_position_embeddings in config.json)"
        )
    return max_model_len


def build_engine(
    split_dir: Path,
    workers: list[str],
    engine_config: EngineConfig,
    expert_timeout_s: float = 60.0,
    tls: TlsFiles | None = None,
    expert_frames: bool = True,
    frame_spin_s: float = 0.0,
    expert_overlap: bool | None = None,
    dense_kernel: str = "auto",
    local_experts: LocalExpertsSpec | None = None,
    distributed: str | None = None,
    served_model_names: Sequence[str] = (),
) -> tuple[Engine, RequestPreparer, core_pb2.ModelInfo]:
    """`workers`: addresses of expert worker processes; `local_experts`: the layers whose experts
    core computes itself (expert_link/local.py). Together they must cover every MoE layer.
    `distributed`: carry the workers' layer calls in-graph on this mx.distributed backend
    (expert_link/distributed.py). `served_model_names`: the name requests and replies use, then
    aliases (default: the checkpoint's folder name)."""
    manifest = Manifest.load(split_dir)
    tokenizer = load_core_tokenizer(split_dir, manifest)
    text_config = model_text_config(manifest.config)
    model_id, *aliases = served_model_names or [manifest.model_id(split_dir)]
    context_length = context_length_of(text_config, engine_config.max_model_len)
    preparer = RequestPreparer(
        tokenizer, model_id, context_length, vocab_size_of(text_config), tuple(aliases)
    )
    preparer.images = image_preparer(split_dir, manifest, engine_config.image_cache_bytes)
    preparer.images_refused = images_refused(manifest.config) or preparer.images_refused

    local_layers = set(local_experts.owned(manifest)) if local_experts else set()
    remote_layers = {layer.layer for layer in manifest.layers} - local_layers
    if remote_layers and not workers:
        raise ValueError(
            f"layers {format_ranges(sorted(remote_layers))} have no expert worker: "
            "give --worker addresses, or serve them locally (--worker local)"
        )

    if distributed and engine_config.micro_batches > 1:
        # In-graph calls are evaluated when the graph is, in an order no lane controls, and every
        # member must issue its collectives in the same order.
        raise ValueError("--micro-batches above 1 needs the frame or gRPC data path, not --distributed")

    drafts_with_mtp = engine_config.speculative is not None and engine_config.speculative.method == "mtp"
    if drafts_with_mtp:
        check_mtp_servable(split_dir, manifest.config)

    def loader():
        local_modules, dispatcher, plane = {}, None, None
        if local_layers:
            local = LocalExperts(split_dir, manifest, local_experts)
            engine.closers.append(local.close)
            local_modules = local.modules()
        if remote_layers:
            dispatcher = ExpertDispatcher(
                manifest,
                workers,
                call_timeout_s=expert_timeout_s,
                tls=tls,
                frames=expert_frames,
                frame_spin_s=frame_spin_s,
                overlap=expert_overlap,
                layers=remote_layers,
            )
            engine.closers.append(dispatcher.close)
            engine.expert_links = dispatcher
            if distributed:
                plane = DataPlane(dispatcher, distributed, stuck_s=expert_timeout_s)
                plane.watch(lambda: engine.busy_since)
                engine.closers.insert(0, plane.stop)
                engine.step_failure = plane.step_failure(engine.step_failure)
                local_modules.update({layer: DistributedExperts(layer, plane) for layer in remote_layers})
        started = time.monotonic()
        model, on_kernel = load_core_model(split_dir, manifest, dispatcher, dense_kernel, local_modules)
        if drafts_with_mtp:
            model.mtp_draft = load_mtp(model, split_dir, manifest.config)  # core's own: never on workers
        if preparer.images is not None:
            try:  # a plain attribute: the vision model's arrays are not core's parameters
                vision = load_vision(split_dir, manifest, model, engine_config.image_cache_bytes)
                object.__setattr__(model, "vision_prefill", vision)
            except VisionUnsupported as error:  # text still serves
                log.warning("images_off", reason=str(error))
                preparer.images, preparer.images_refused = None, f"is served for text only: {error}"
        log.info(
            "core_model_loaded",
            seconds=round(time.monotonic() - started, 2),
            layers=len(manifest.layers),
            projections_on_cpu_kernel=on_kernel,
        )
        load_stage_done("weights_read", time.monotonic() - started, layers=len(manifest.layers))
        started = time.monotonic()
        # The grammar engine's view of the vocabulary takes seconds and holds the GIL: build it
        # before core reports SERVING, not on the first constrained request of a live server.
        # A tokenizer llguidance cannot read costs only constrained requests, which then fail clearly.
        try:
            preparer.output_preparer.grammar_tokenizer.get()
            log.info("grammar_vocabulary_ready", seconds=round(time.monotonic() - started, 2))
        except GrammarError as error:
            log.warning("constrained_decoding_unavailable", error=str(error))
        # TurboQuant's fused kernels pass a self-check against the twin before first use
        # (seconds on a CPU or a Mac, a minute of NVRTC compiles on a fresh CUDA machine; the
        # pass is kept per device and kernel build). Before SERVING where TurboQuant is the
        # default cache; otherwise at the first request that asks for it.
        if engine_config.kv_cache == "turboquant":
            started = time.monotonic()
            backend = kernel_backend()
            log.info(
                "turboquant_kernels_ready",
                backend=getattr(backend, "__name__", "pure-MLX twin"),
                seconds=round(time.monotonic() - started, 2),
            )
        load_stage_done("kernels_ready", time.monotonic() - started, kv_cache=engine_config.kv_cache)
        plain = turboquant_unsupported_layers(model)
        if plain:  # requests asking for TurboQuant still get it wherever it applies
            log.info(
                "turboquant_layers",
                plain_cache_layers=len(plain),
                reason="MLA, attention sinks or chunked attention",
            )
        if dispatcher is None:  # every layer local: nothing to probe, no layer calls to time
            return model, list, LayerCallTimings()
        return model, plane.probe if plane else dispatcher.discover, dispatcher.timings

    engine = Engine(tokenizer, engine_config, loader)
    per_token, _ = kv_bytes_per_token(manifest.config, 2.0)
    engine.kv_cache_capacity_bytes = int(per_token * context_length * engine_config.max_num_seqs)
    info = core_pb2.ModelInfo(
        id=model_id,
        model_type=manifest.model_type,
        context_length=context_length,
        fingerprint=manifest.fingerprint,
        created=int(Path(split_dir, "manifest.json").stat().st_mtime),
    )
    return engine, preparer, info


async def serve_core(
    split_dir: Path,
    listen: str,
    workers: list[str],
    engine_config: EngineConfig | None = None,
    expert_timeout_s: float = 60.0,
    tls: TlsFiles | None = None,
    insecure: bool = False,
    metrics: str | None = None,
    expert_frames: bool = True,
    frame_spin_s: float = 0.0,
    expert_overlap: bool | None = None,
    dense_kernel: str = "auto",
    local_experts: LocalExpertsSpec | None = None,
    distributed: str | None = None,
    served_model_names: Sequence[str] = (),
    quiet: bool = False,
    drain_s: float = 1.0,
) -> None:
    """`quiet`: no periodic stats lines (stats_line.py); `drain_s`: how long health says
    NOT_SERVING on SIGTERM before new requests are refused, so health checkers move away; `tls`: mTLS for the Core server and the
    links to workers; `metrics`: host:port of the Prometheus endpoint (None = none); `expert_frames`: use same-host workers' frame sockets;
    `frame_spin_s`: how long reading their answers polls before it sleeps; `expert_overlap`:
    build the next layer while a layer's experts compute (ExpertDispatcher.call); `dense_kernel`:
    "auto" computes quantized projections with metal/linear_cpu.py where MLX runs on the CPU;
    `distributed`: the in-graph data plane's backend (None: off)."""
    refuse_insecure_bind(listen, tls, insecure)  # before loading anything
    engine, preparer, info = build_engine(
        split_dir,
        workers,
        engine_config or EngineConfig(),
        expert_timeout_s,
        tls,
        expert_frames,
        frame_spin_s,
        expert_overlap,
        dense_kernel,
        local_experts,
        distributed,
        served_model_names,
    )
    running = await start_server(
        lambda server: core_pb2_grpc.add_CoreServicer_to_server(CoreServicer(engine, preparer, info), server),
        SERVICE_NAME,
        listen,
        max_message_bytes=64 * 1024 * 1024,
        serving=False,  # until the model is loaded and every expert is reachable
        tls=tls,
        insecure=insecure,
    )
    start_metrics_server(metrics)
    loop = asyncio.get_running_loop()

    announced = False

    def on_health(serving: bool) -> None:  # called on the engine thread
        nonlocal announced
        if serving and not announced:
            announced = True
            load_stage_done("experts_mapped", workers=len(workers), local=bool(local_experts))
            load_stage_done("serving", address=running.address, model=info.id)
        asyncio.run_coroutine_threadsafe(running.set_serving(serving), loop)

    engine.on_health(on_health)

    def on_engine_death(error: BaseException) -> None:  # called on the dying engine thread
        log.critical("core_exiting", reason=f"the engine thread died: {error!r}", exit_code=ENGINE_DIED)
        os._exit(ENGINE_DIED)  # for the supervisor to start core again; nothing would serve

    engine.on_fatal = on_engine_death
    stats_lines = None if quiet else asyncio.create_task(log_stats_lines(lambda: cluster_stats(engine)))
    log.info("core_listening", address=running.address, workers=workers, model=info.id)
    engine.start()
    await loop.run_in_executor(None, engine.loaded.wait)
    if engine.load_error is not None:
        await running.server.stop(0)
        raise SystemExit(f"core: cannot load the model: {engine.load_error}")

    async def on_stop() -> None:
        if stats_lines is not None:
            stats_lines.cancel()
        await loop.run_in_executor(None, engine.stop)

    # In-flight generations get 10 s after health has said NOT_SERVING for drain_s.
    await running.serve_until_signal(on_stop, grace_s=10.0, drain_delay_s=drain_s)


def run_core(mlx_cache_bytes: int | None = None, **kwargs) -> None:
    """`mlx_cache_bytes`: MLX's cache of freed buffers is held under this, so core's memory is
    its weights, the KV and prefix-cache budgets and this (what `moe-mesh plan` states)."""
    if mlx_cache_bytes is not None:
        import mlx.core as mx

        mx.set_cache_limit(mlx_cache_bytes)
    install_uvloop()
    asyncio.run(serve_core(**kwargs))
