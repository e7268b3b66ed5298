"""The ExpertWorker gRPC servicer: a thin translator over ExpertCompute.

A malformed call is answered in-band (`ExpertResult.error`, INVALID_ARGUMENT naming
the field) so the long-lived stream survives it; a failure of the store (a bad
read) or of the math is answered the same way with INTERNAL. The worker never dies of a call.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

import grpc
import structlog
from prometheus_client import REGISTRY, generate_latest

from services.common.logging import REQUEST_ID_METADATA_KEY, get_logger
from services.common.mlx_threads import MlxThread
from services.experts.compute import CallRejected, ExpertCompute
from services.experts.store import ExpertFileError
from services.experts.store_setup import describe_cache
from services.proto.moemesh.v1 import expert_pb2, expert_pb2_grpc

log = get_logger(__name__)
# A call with more tokens than this (a prefill chunk) is computed on a thread, so that the event
# loop answers health checks, Describe and other streams meanwhile; smaller ones (decode steps,
# a few ms) are answered on the loop, where a thread hop would add to every token's latency.
OFF_LOOP_TOKENS = 32


class ExpertWorkerServicer(expert_pb2_grpc.ExpertWorkerServicer):
    def __init__(self, compute: ExpertCompute, worker_id: str, memory_budget_bytes: int = 0):
        self.compute = compute
        self.worker_id = worker_id
        self.memory_budget_bytes = memory_budget_bytes
        self.calls = 0
        self.frames_path = ""  # set when the frame socket serves (services/experts/frame_server.py)
        self.data_plane = None  # a DataPlaneWorker when the worker joins core's group
        self.rejected = 0
        # Request ids seen recently: each is logged once when it first reaches this worker,
        # not once per layer call (that would be layers x tokens lines per request).
        self._seen_requests: dict[str, None] = {}
        # Calls come from the event loop (Forward) and from frame-socket threads; the store
        # and MLX see one call at a time.
        self._answering = threading.Lock()
        self._long_calls = MlxThread("long-call")

    async def Describe(self, request, context):
        if request.join_data_plane and self.data_plane is not None:
            self.data_plane.start()  # joins once, after this answer has gone
        store = self.compute.store
        reply = expert_pb2.DescribeResponse(
            model_fingerprint=self.compute.manifest.fingerprint,
            memory_budget_bytes=self.memory_budget_bytes,
            resident_bytes=store.stats().resident_bytes,
            worker_id=self.worker_id,
            frames_path=self.frames_path,
            num_experts=self.compute.manifest.num_experts,
            hidden_dtype=self.compute.manifest.dtype,
            data_plane_rank=self.data_plane.rank if self.data_plane is not None else 0,
        )
        describe_cache(reply, store.stats())
        for layer, experts in sorted(store.owned.items()):
            reply.layers.add(
                layer=layer, experts=experts, resident=[store.is_resident(layer, e) for e in experts]
            )
        if request.include_metrics:
            reply.metrics_text = generate_latest(REGISTRY).decode()
        return reply

    async def Forward(self, request_iterator, context: grpc.aio.ServicerContext):
        metadata = dict(context.invocation_metadata() or ())
        structlog.contextvars.bind_contextvars(link_id=metadata.get(REQUEST_ID_METADATA_KEY, ""))
        log.info("forward_stream_open", peer=context.peer())
        loop = asyncio.get_running_loop()
        async for call in request_iterator:
            # (also a small call while another stream's call holds the lock: the loop never waits on it)
            if (call.hidden.shape and call.hidden.shape[0] > OFF_LOOP_TOKENS) or self._answering.locked():
                context_vars = contextvars.copy_context()  # the stream's log fields go along
                yield await loop.run_in_executor(self._long_calls, context_vars.run, self.answer, call)
            else:
                yield self.answer(call)
        log.info("forward_stream_closed", peer=context.peer())

    def close(self) -> None:
        """Ends the thread that answers long calls (after the server has stopped)."""
        self._long_calls.close()

    def answer(self, call: expert_pb2.ExpertCall) -> expert_pb2.ExpertResult:
        """The result of one call, for Forward and the frame socket alike: a malformed call or
        a failed read is answered in-band, never raised."""
        with self._answering:
            return self._answer(call)

    def _answer(self, call: expert_pb2.ExpertCall) -> expert_pb2.ExpertResult:
        self.calls += 1
        if call.request_ids:
            self._log_new_requests(call)
        try:
            return self.compute.run(call)
        except CallRejected as error:
            self.rejected += 1
            log.warning(
                "call_rejected",
                call_id=call.call_id,
                request_ids=list(call.request_ids),
                layer=call.layer,
                field=error.field,
                error=str(error),
            )
            return _error(call.call_id, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except ExpertFileError as error:
            log.error("expert_read_failed", call_id=call.call_id, layer=call.layer, error=str(error))
            return _error(call.call_id, grpc.StatusCode.INTERNAL, str(error))
        except Exception as error:  # the math itself failed (e.g. MLX has no kernel for it)
            # answered in-band like the rest: the stream, and every other call on it, carries on
            log.exception("call_failed", call_id=call.call_id, layer=call.layer)
            message = f"layer {call.layer}: the experts' computation failed: {type(error).__name__}: {error}"
            return _error(call.call_id, grpc.StatusCode.INTERNAL, message)

    def _log_new_requests(self, call) -> None:
        for request_id in call.request_ids:
            if request_id not in self._seen_requests:
                self._seen_requests[request_id] = None
                log.info("request_seen", request_id=request_id, call_id=call.call_id, layer=call.layer)
        while len(self._seen_requests) > 4096:
            del self._seen_requests[next(iter(self._seen_requests))]


def _error(call_id: int, code: grpc.StatusCode, message: str) -> expert_pb2.ExpertResult:
    result = expert_pb2.ExpertResult(call_id=call_id)
    result.error.code = code.value[0]
    result.error.message = message
    return result
