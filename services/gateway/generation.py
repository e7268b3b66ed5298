"""Run one `Core.Generate` call for an HTTP request and answer whole or as server-sent events.

Contract, for every API (chat, completions, Anthropic messages):
- a core error before the first chunk is a normal HTTP error (429, 404, 400 ...) in the API's
  shape; one after streaming began is sent as the API's error event and the stream ends, since the
  status line is gone;
- a client that goes away cancels the core call, so core frees the sequence and its KV cache now
  rather than generating for nobody until max_tokens;
- successful requests are timed into the Prometheus metrics and logged once, with the request id
  (bound by the middleware) on the line.
The API-specific shapes live in the formatters (`chat_format`, `completions_format`,
`anthropic_format`), which all implement `ResponseFormatter`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common.logging import get_logger
from services.gateway.chat_format import usage_json
from services.gateway.choices import merged_choices, merged_usage
from services.gateway.core_client import CoreClient
from services.gateway.errors import OpenAIError, error_from_grpc, internal_error
from services.gateway.generation_state import GenerationState, MissingFinishReason
from services.gateway.metrics import GatewayMetrics, RequestTimer
from services.proto.moemesh.v1 import core_pb2

log = get_logger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; nobody receives it
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ResponseFormatter(Protocol):
    """Turns the chunks of one Generate stream into one API's response objects or SSE frames."""

    state: GenerationState
    log_event: str

    def result(self) -> dict[str, Any]: ...
    def opening(self, first: core_pb2.GenerateChunk) -> list[bytes]: ...
    def on_chunk(self, chunk: core_pb2.GenerateChunk) -> list[bytes]: ...
    def closing(self) -> list[bytes]: ...
    def error_event(self, error: OpenAIError) -> bytes: ...


class _Disconnect:
    """Watches the HTTP connection and cancels the core calls when the client goes away."""

    def __init__(self, request: Request, *calls: grpc.aio.UnaryStreamCall) -> None:
        self.happened = False
        self._task = asyncio.create_task(self._watch(request, calls))

    async def _watch(self, request: Request, calls: tuple[grpc.aio.UnaryStreamCall, ...]) -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a receive that fails means the connection is gone too
            log.debug("receive failed; treating it as a disconnect", exc_info=True)
        self.happened = True
        for call in calls:
            call.cancel()
        log.info("client disconnected; core calls cancelled", calls=len(calls))

    def stop(self) -> None:
        self._task.cancel()


def _cancelled_by_us(disconnect: _Disconnect) -> bool:
    """A cancelled gRPC call raises CancelledError in its reader; tell it apart from this task
    being cancelled (which must propagate)."""
    task = asyncio.current_task()
    return disconnect.happened and (task is None or task.cancelling() == 0)


def _prompt_param(generate: core_pb2.GenerateRequest) -> str:
    return "messages" if generate.WhichOneof("input") == "chat" else "prompt"


async def serve_generation(
    request: Request,
    generate: core_pb2.GenerateRequest,
    formatter: ResponseFormatter,
    *,
    stream: bool,
    model_label: str,
) -> Response:
    """One Generate call for one request, answered whole or streamed."""
    return await serve_generations(
        request, [generate], [formatter], n=1, stream=stream, model_label=model_label
    )


async def serve_generations(
    request: Request,
    generates: list[core_pb2.GenerateRequest],
    formatters: list[ResponseFormatter],
    *,
    n: int,
    stream: bool,
    model_label: str,
) -> Response:
    """Generate calls for one request, one per formatter; several for `n` choices or a batch of
    prompts (choices.py), each formatter rendering its choice. They run at once, so core batches
    them. Answered whole, or streamed as their chunks come, interleaved. Until every call's first
    chunk is in, a failure is a plain HTTP error; the first call that fails fails the request and
    cancels the others, as a client that goes away does."""
    core: CoreClient = request.app.state.core
    metrics: GatewayMetrics = request.app.state.metrics
    calls = [core.generate(generate) for generate in generates]
    timers = [RequestTimer(metrics, model_label) for _ in calls]
    disconnect = _Disconnect(request, *calls)
    prompt_param = _prompt_param(generates[0])
    tasks: list[asyncio.Task] = []
    streaming = False
    try:
        firsts = await asyncio.gather(*(call.read() for call in calls))
        if stream:
            streaming = True
            if len(calls) == 1:
                frames = _sse(calls[0], prompt_param, firsts[0], formatters[0], disconnect, timers[0])
            else:
                frames = _interleaved_sse(calls, firsts, formatters, timers, n, disconnect, prompt_param)
            return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
        tasks = [
            asyncio.create_task(_whole(*parts))
            for parts in zip(calls, firsts, formatters, timers, strict=True)
        ]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        results = [task.result() for task in tasks]
        return JSONResponse(results[0] if len(results) == 1 else merged_choices(results, n))
    except grpc.aio.AioRpcError as error:
        raise _logged(error_from_grpc(error, prompt_param), error) from None
    except MissingFinishReason as error:
        log.error(str(error))
        raise internal_error() from None
    except asyncio.CancelledError:
        if _cancelled_by_us(disconnect):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise
    finally:
        if not streaming:  # the stream generator owns calls and watcher from here on
            _cancel(disconnect, calls, tasks)
            await asyncio.gather(*tasks, return_exceptions=True)


def _cancel(disconnect: _Disconnect, calls: list, tasks: list[asyncio.Task]) -> None:
    disconnect.stop()
    for call in calls:
        call.cancel()  # no-op when finished; frees the sequence in core otherwise
    for task in tasks:
        task.cancel()


_CHOICE_DONE = object()


async def _interleaved_sse(
    calls: list,
    firsts: list,
    formatters: list,
    timers: list[RequestTimer],
    n: int,
    disconnect: _Disconnect,
    prompt_param: str,
) -> AsyncIterator[bytes]:
    """The frames of several calls as each comes, then one usage chunk for them all and [DONE]."""
    frames: asyncio.Queue = asyncio.Queue()

    async def pump(call, first, formatter: ResponseFormatter, timer: RequestTimer) -> None:
        try:
            frames.put_nowait(b"".join(formatter.opening(first)))
            chunk = first
            while chunk is not grpc.aio.EOF:
                formatter.state.add(chunk)
                timer.on_chunk(chunk)
                frames.put_nowait(b"".join(formatter.on_chunk(chunk)))
                chunk = await call.read()
            formatter.state.require_finished()
            _done(formatter, timer, stream=True)
            frames.put_nowait(_CHOICE_DONE)
        except Exception as error:  # noqa: BLE001 - handed to the stream, which reports it
            frames.put_nowait(error)
        except asyncio.CancelledError as cancelled:  # its call was cancelled: the stream ends too
            frames.put_nowait(cancelled)
            raise

    tasks = [
        asyncio.create_task(pump(*parts)) for parts in zip(calls, firsts, formatters, timers, strict=True)
    ]
    try:
        finished = 0
        while finished < len(tasks):
            item = await frames.get()
            if item is _CHOICE_DONE:
                finished += 1
            elif isinstance(item, BaseException):
                raise item
            elif item:
                yield item
        usage = merged_usage([usage_json(formatter.state) for formatter in formatters], n)
        yield b"".join(formatters[0].closing(usage))
    except grpc.aio.AioRpcError as error:
        yield formatters[0].error_event(_logged(error_from_grpc(error, prompt_param), error))
    except MissingFinishReason as error:
        log.error(str(error))
        yield formatters[0].error_event(internal_error())
    except asyncio.CancelledError:
        if not _cancelled_by_us(disconnect):
            raise
    except Exception:  # the status line is sent: an error event is all we can still do
        log.exception("stream failed")
        yield formatters[0].error_event(internal_error())
    finally:
        _cancel(disconnect, calls, tasks)


async def _whole(
    call: grpc.aio.UnaryStreamCall, first: Any, formatter: ResponseFormatter, timer: RequestTimer
) -> dict[str, Any]:
    """Read a call to its end (`first`: its first chunk, read already) into the formatter's
    whole response."""
    chunk = first
    while chunk is not grpc.aio.EOF:
        formatter.state.add(chunk)
        timer.on_chunk(chunk)
        chunk = await call.read()
    result = formatter.result()
    _done(formatter, timer, stream=False)
    return result


async def _sse(
    call: grpc.aio.UnaryStreamCall,
    prompt_param: str,
    first: Any,
    formatter: ResponseFormatter,
    disconnect: _Disconnect,
    timer: RequestTimer,
) -> AsyncIterator[bytes]:
    try:
        for frame in formatter.opening(first):
            yield frame
        chunk = first
        while chunk is not grpc.aio.EOF:
            formatter.state.add(chunk)
            timer.on_chunk(chunk)
            frames = formatter.on_chunk(chunk)
            if frames:
                yield b"".join(frames)
            chunk = await call.read()
        yield b"".join(formatter.closing())
        _done(formatter, timer, stream=True)
    except grpc.aio.AioRpcError as error:
        yield formatter.error_event(_logged(error_from_grpc(error, prompt_param), error))
    except MissingFinishReason as error:
        log.error(str(error))
        yield formatter.error_event(internal_error())
    except asyncio.CancelledError:
        if not _cancelled_by_us(disconnect):
            raise
    except Exception:  # the status line is sent: an error event is all we can still do
        log.exception("stream failed")
        yield formatter.error_event(internal_error())
    finally:
        _cancel(disconnect, [call], [])


def _logged(error: OpenAIError, cause: grpc.aio.AioRpcError) -> OpenAIError:
    log.warning("core call failed", status=error.status, grpc_code=cause.code().name, details=cause.details())
    return error


def _done(formatter: ResponseFormatter, timer: RequestTimer, *, stream: bool) -> None:
    state = formatter.state
    timer.finished(state)
    log.info(
        formatter.log_event,
        stream=stream,
        finish_reason=core_pb2.FinishReason.Name(state.finish_reason or 0),
        prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens,
        duration_ms=round((time.perf_counter() - timer.started) * 1000, 1),
    )
