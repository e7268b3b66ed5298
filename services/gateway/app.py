"""The gateway's FastAPI app: OpenAI HTTP in front of core's gRPC `Generate` stream.

Contract:
- `POST /v1/chat/completions`: `chat.completion`, or with `stream: true` SSE `chat.completion.chunk`
  events (role chunk, content/tool-call deltas, finish chunk, optional usage chunk, `[DONE]`).
  A core error before the first token is a normal HTTP error (429, 404, ...); one after streaming
  began is sent as `data: {"error": ...}` and the stream ends, since the status line is gone.
- `GET /v1/models`: core's ListModels as an OpenAI list. `GET /health`: 200 while the gateway runs,
  with core's grpc.health status alongside.
- A client that goes away cancels the core call, so core frees the sequence and its KV cache now
  rather than generating for nobody until max_tokens.
The gateway holds no state besides the gRPC channel: any number of them can front one core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common.logging import get_logger
from services.gateway.core_client import CoreClient, CoreClientConfig, build_generate_request
from services.gateway.errors import OpenAIError, error_from_grpc, install_error_handlers, internal_error
from services.gateway.middleware import BodySizeLimitMiddleware, RequestIdMiddleware
from services.gateway.openai_schema import ChatCompletionRequest
from services.gateway.responses import (
    CompletionMeta,
    CompletionState,
    MissingFinishReason,
    chunk_json,
    sse_event,
    stream_chunks,
    usage_chunk_json,
)
from services.proto.moemesh.v1 import core_pb2

log = get_logger(__name__)
router = APIRouter()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; nobody receives it


def create_app(
    core_target: str,
    *,
    model_name_hint: str | None = None,
    generate_timeout_s: float = 600.0,
    unary_timeout_s: float = 5.0,
    max_body_bytes: int = 32 * 1024 * 1024,
) -> FastAPI:
    """Build the app; the core channel opens at startup (inside uvicorn's loop) and closes at shutdown."""
    config = CoreClientConfig(
        core_target, generate_timeout_s=generate_timeout_s, unary_timeout_s=unary_timeout_s
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.core = CoreClient(config)
        log.info("gateway started", core_target=core_target)
        try:
            yield
        finally:
            await app.state.core.close()

    app = FastAPI(
        title="moe-mesh gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.model_name_hint = model_name_hint
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # added last = outermost: sees every response
    app.include_router(router)
    return app


class _Disconnect:
    """Watches the HTTP connection and cancels the core call when the client goes away."""

    def __init__(self, request: Request, call: grpc.aio.UnaryStreamCall) -> None:
        self.happened = False
        self._task = asyncio.create_task(self._watch(request, call))

    async def _watch(self, request: Request, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a receive that fails means the connection is gone too
            log.debug("receive failed; treating it as a disconnect", exc_info=True)
        self.happened = True
        call.cancel()
        log.info("client disconnected; core call cancelled")

    def stop(self) -> None:
        self._task.cancel()


def _cancelled_by_us(disconnect: _Disconnect) -> bool:
    """A cancelled gRPC call raises CancelledError in its reader; tell it apart from this task
    being cancelled (which must propagate)."""
    task = asyncio.current_task()
    return disconnect.happened and (task is None or task.cancelling() == 0)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    request_id: str = request.state.request_id
    meta = CompletionMeta(
        id=request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id}",
        created=int(time.time()),
        model=body.model or request.app.state.model_name_hint or "",
    )
    core: CoreClient = request.app.state.core
    call = core.generate(build_generate_request(body, request_id))
    disconnect = _Disconnect(request, call)
    started = time.perf_counter()
    state = CompletionState()
    streaming = False
    try:
        first = await call.read()
        if body.stream:
            streaming = True
            return StreamingResponse(
                _sse_stream(call, first, state, meta, body, disconnect, started),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        chunk = first
        while chunk is not grpc.aio.EOF:
            state.add(chunk)
            chunk = await call.read()
        result = state.completion(meta, with_logprobs=body.logprobs)
        _log_done(state, started, stream=False)
        return JSONResponse(result)
    except grpc.aio.AioRpcError as error:
        raise _logged(error_from_grpc(error), error) from None
    except MissingFinishReason as error:
        log.error(str(error))
        raise internal_error() from None
    except asyncio.CancelledError:
        if _cancelled_by_us(disconnect):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise
    finally:
        if not streaming:  # the stream generator owns call and watcher from here on
            disconnect.stop()
            call.cancel()


async def _sse_stream(
    call: grpc.aio.UnaryStreamCall,
    first: Any,
    state: CompletionState,
    meta: CompletionMeta,
    body: ChatCompletionRequest,
    disconnect: _Disconnect,
    started: float,
) -> AsyncIterator[bytes]:
    include_usage = body.include_usage_in_stream()
    try:
        yield sse_event(chunk_json(meta, {"role": "assistant", "content": ""}, include_usage=include_usage))
        chunk = first
        while chunk is not grpc.aio.EOF:
            state.add(chunk)
            for event in stream_chunks(meta, chunk, state, include_usage=include_usage):
                yield sse_event(event)
            chunk = await call.read()
        if state.finish_reason is None:
            raise MissingFinishReason("core ended the stream without a finish reason")
        if include_usage:
            yield sse_event(usage_chunk_json(meta, state.usage()))
        yield sse_event("[DONE]")
        _log_done(state, started, stream=True)
    except grpc.aio.AioRpcError as error:
        yield sse_event(_logged(error_from_grpc(error), error).body())
    except MissingFinishReason as error:
        log.error(str(error))
        yield sse_event(internal_error().body())
    except asyncio.CancelledError:
        if not _cancelled_by_us(disconnect):
            raise
    except Exception:  # the status line is sent: an error event is all we can still do
        log.exception("stream failed")
        yield sse_event(internal_error().body())
    finally:
        disconnect.stop()
        call.cancel()  # no-op when finished; frees the sequence in core when the client left early


def _logged(error: OpenAIError, cause: grpc.aio.AioRpcError) -> OpenAIError:
    log.warning("core call failed", status=error.status, grpc_code=cause.code().name, details=cause.details())
    return error


def _log_done(state: CompletionState, started: float, *, stream: bool) -> None:
    log.info(
        "chat completion",
        stream=stream,
        finish_reason=state.finish_reason,
        prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens,
        duration_ms=round((time.perf_counter() - started) * 1000, 1),
    )


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    core: CoreClient = request.app.state.core
    try:
        models = await core.list_models(request.state.request_id)
    except grpc.aio.AioRpcError as error:
        raise _logged(error_from_grpc(error), error) from None
    return {"object": "list", "data": [_model_json(model) for model in models]}


def _model_json(model: core_pb2.ModelInfo) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": model.created or 0,
        "owned_by": "moe-mesh",
        "max_model_len": model.context_length or None,  # vLLM's name for the context length
    }


@router.get("/health")
async def health(request: Request) -> dict[str, str]:
    """Liveness of the gateway (always 200 while it runs) plus core's readiness for dashboards."""
    core: CoreClient = request.app.state.core
    return {"status": "ok", "core": await core.health()}
