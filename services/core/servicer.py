"""The Core gRPC servicer: validate, hand to the engine, stream what it emits.

Leaving the response stream early (client cancel, disconnect, deadline) cancels the
sequence in the engine, which frees it and its KV cache before the next step.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import structlog

from services.common.grpc_util import not_serving_details
from services.common.logging import REQUEST_ID_METADATA_KEY, get_logger
from services.core.admission import Overloaded
from services.core.cluster_status import cluster_metrics, cluster_stats
from services.core.engine import Engine, EngineError
from services.core.request_prep import MAX_REQUEST_ID_CHARS, RequestError, RequestPreparer
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

log = get_logger(__name__)


class CoreServicer(core_pb2_grpc.CoreServicer):
    def __init__(self, engine: Engine, preparer: RequestPreparer, model_info: core_pb2.ModelInfo):
        self.engine = engine
        self.preparer = preparer
        self.model_info = model_info
        # Tokenizing and templating a request (and compiling its grammar) takes from microseconds
        # to seconds; off the event loop, so other streams and health checks go on meanwhile. One
        # thread: requests are prepared in arrival order, as before.
        self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")

    async def _off_loop(self, work, *args):
        context = contextvars.copy_context()  # the request's log fields go along
        return await asyncio.get_running_loop().run_in_executor(self._prepare, context.run, work, *args)

    async def Generate(self, request: core_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        metadata = dict(context.invocation_metadata() or ())
        if not request.request_id:  # made here, so that every log line of the request carries it
            request.request_id = metadata.get(REQUEST_ID_METADATA_KEY, "") or uuid.uuid4().hex
        # (an over-long id is refused by prepare(); the logs never carry more than the limit)
        structlog.contextvars.bind_contextvars(request_id=request.request_id[:MAX_REQUEST_ID_CHARS])
        if self.engine.problems:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, not_serving_details("; ".join(self.engine.problems))
            )
        try:
            remaining = context.time_remaining()  # from now, not from when the prepare thread is free
            deadline = None if remaining is None else time.monotonic() + remaining
            prepared = await self._off_loop(self.preparer.prepare, request, deadline)
        except RequestError as error:
            await context.abort(error.code, str(error))
        if request.kv_cache and request.kv_cache not in self.engine.kv_cache_kinds:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"kv_cache: unknown kind {request.kv_cache!r}; one of {', '.join(self.engine.kv_cache_kinds)}",
            )
        prepared.kv_cache = request.kv_cache
        out: asyncio.Queue = asyncio.Queue()
        try:
            sequence = self.engine.submit(prepared, out, asyncio.get_running_loop())
        except Overloaded as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        log.info("generate_start", prompt_tokens=len(prepared.prompt), max_tokens=prepared.max_tokens)
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, EngineError):
                    finished = True
                    log.warning("generate_failed", code=item.code.name, error=item.message)
                    unavailable = item.code == grpc.StatusCode.UNAVAILABLE
                    await context.abort(
                        item.code, not_serving_details(item.message) if unavailable else item.message
                    )
                yield item
                if item.finish_reason:
                    finished = True
                    log.info(
                        "generate_done",
                        finish=core_pb2.FinishReason.Name(item.finish_reason),
                        completion_tokens=item.usage.completion_tokens,
                    )
                    return
        finally:
            if not finished:
                log.info("generate_cancelled")
                self.engine.cancel(sequence)

    async def ListModels(self, request, context):
        names, preparer = self.preparer.model_names, self.preparer
        models = [_named(self.model_info, name) for name in names]
        for model in models:  # read now: loading the vision tower may have turned images off
            model.images_refused = "" if preparer.images is not None else preparer.images_refused
        return core_pb2.ListModelsResponse(models=models)

    async def CountTokens(self, request: core_pb2.CountTokensRequest, context):
        try:
            self.preparer.check_model(request.model)
            ids = await self._off_loop(self.preparer.prompt_tokens, request)
            return core_pb2.CountTokensResponse(count=len(ids), ids=ids if request.return_ids else ())
        except RequestError as error:
            await context.abort(error.code, str(error))

    async def Detokenize(self, request: core_pb2.DetokenizeRequest, context):
        try:
            self.preparer.check_model(request.model)
            return core_pb2.DetokenizeResponse(
                text=await self._off_loop(self.preparer.detokenize, request.ids)
            )
        except RequestError as error:
            await context.abort(error.code, str(error))

    async def GetStats(self, request, context):
        stats = await cluster_stats(self.engine)
        if self.engine.layer_call_timings is not None:
            fill_layer_call_stats(
                stats.layer_calls, *self.engine.layer_call_timings.snapshot_all(request.reset_layer_calls)
            )
        return stats

    async def GetMetrics(self, request, context):
        return await cluster_metrics(self.engine)


def fill_layer_call_stats(
    out: core_pb2.LayerCallStats, calls: np.ndarray, parts: dict[str, np.ndarray] | None = None
) -> None:
    """calls: [n, 3] (total, worker, compute) microseconds per layer call; parts: each named
    part's microseconds (LayerCallTimings.record_part)."""
    out.calls = len(calls)
    for name, values in (parts or {}).items():
        if len(values):
            out.part_p50_us[name], out.part_p99_us[name] = (float(v) for v in np.percentile(values, [50, 99]))
    if not len(calls):
        return
    total, worker, compute = calls[:, 0], calls[:, 1], calls[:, 2]
    for name, values in (
        ("total", total),
        ("worker", worker),
        ("compute", compute),
        ("transport", total - worker),
    ):
        p50, p99 = np.percentile(values, [50, 99])
        setattr(out, f"{name}_p50_us", float(p50))
        setattr(out, f"{name}_p99_us", float(p99))


def _named(info: core_pb2.ModelInfo, name: str) -> core_pb2.ModelInfo:
    """The served model's info under one of its names."""
    named = core_pb2.ModelInfo()
    named.CopyFrom(info)
    named.id = name
    return named
