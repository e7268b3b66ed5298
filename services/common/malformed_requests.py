"""A request whose bytes do not parse is the client's error: INVALID_ARGUMENT, saying so.

grpcio answers a message its deserializer cannot parse with UNKNOWN ("Unexpected
DecodeError"), as if the server had failed. This interceptor, installed on every server
(services/common/grpc_util.start_server), parses with a deserializer that hands the servicer
nothing and the method an abort with INVALID_ARGUMENT instead: for unary requests before the
servicer runs, for streamed requests when the stream reaches the bad message (the calls
before it were already answered; the stream ends there, since the bad message has no call id
to answer in-band).
"""

from __future__ import annotations

import inspect

import grpc


class MalformedRequest:
    """What the tolerant deserializer returns for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 - protobuf's DecodeError, or any parser's error
            return MalformedRequest(error)

    return parse


async def _abort(context, method: str, request: MalformedRequest):
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{method}: the request message does not parse: {request.error}",
    )


def _checked_unary_unary(behavior, method):
    async def handle(request, context):
        if isinstance(request, MalformedRequest):
            await _abort(context, method, request)
        return await behavior(request, context)

    return handle


def _checked_unary_stream(behavior, method):
    async def handle(request, context):
        if isinstance(request, MalformedRequest):
            await _abort(context, method, request)
        result = behavior(request, context)
        if inspect.isasyncgen(result):
            async for reply in result:
                yield reply
        else:  # a handler that writes through context.write
            await result

    return handle


def _checked_requests(requests, context, method):
    async def checked():
        async for request in requests:
            if isinstance(request, MalformedRequest):
                await _abort(context, method, request)
            yield request

    return checked()


def _checked_stream_unary(behavior, method):
    async def handle(requests, context):
        return await behavior(_checked_requests(requests, context, method), context)

    return handle


def _checked_stream_stream(behavior, method):
    async def handle(requests, context):
        result = behavior(_checked_requests(requests, context, method), context)
        if inspect.isasyncgen(result):
            async for reply in result:
                yield reply
        else:
            await result

    return handle


_WRAPPERS = {
    "unary_unary": _checked_unary_unary,
    "unary_stream": _checked_unary_stream,
    "stream_unary": _checked_stream_unary,
    "stream_stream": _checked_stream_stream,
}


class RejectMalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        changes = {"request_deserializer": _tolerant(handler.request_deserializer)}
        for kind, wrap in _WRAPPERS.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                if not inspect.iscoroutinefunction(behavior) and not inspect.isasyncgenfunction(behavior):
                    return handler  # a synchronous handler (not used here): left as grpcio runs it
                changes[kind] = wrap(behavior, method)
        return handler._replace(**changes)
